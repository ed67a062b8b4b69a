import torchgpipe


def test_public_names() -> None:
    assert sorted(torchgpipe.__all__) == sorted(
        ["BalanceError", "GPipe", "__version__", "is_checkpointing", "is_recomputing"]
    )
    for name in torchgpipe.__all__:
        assert getattr(torchgpipe, name) is not None


def test_version_is_a_string() -> None:
    assert isinstance(torchgpipe.__version__, str)
    assert torchgpipe.__version__[0].isdigit()


def test_public_objects_are_documented() -> None:
    for name in torchgpipe.__all__:
        obj = getattr(torchgpipe, name)
        if callable(obj):
            assert obj.__doc__, name

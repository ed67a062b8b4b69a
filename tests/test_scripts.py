"""Smoke tests of the demo, the example script and the benchmark: they run and report.

Each runs in a subprocess, as a user would start it, so that the scripts' global
settings (``torch.set_num_threads(1)``, seeds) do not leak into the other tests. Nothing
here asserts a speed: figures belong to the benchmark's own output.
"""

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from torchgpipe import demo

ROOT = Path(__file__).resolve().parent.parent


def run_python(*args: str) -> str:
    done = start_python(*args)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def start_python(*args: str) -> subprocess.CompletedProcess[str]:
    # On the CPU, as the rest of the default run, also where a GPU is present: the
    # scripts' GPU runs are benchmarks/gpu/run.sh's.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )


def test_demo_quick_trains_and_compares_throughput(tmp_path):
    timeline = tmp_path / "timeline.png"  # given without its suffix, which matplotlib adds
    out = run_python("-m", "torchgpipe.demo", "--quick", "--timeline", str(tmp_path / "timeline"))
    losses = [float(v) for v in re.findall(r"step +\d+/\d+ +loss (\d+\.\d+)", out)]
    steps = demo.parse_args(["--quick"]).steps
    assert len(losses) == 2 * steps  # GPipe, then the plain model
    piped, plain = losses[:steps], losses[steps:]
    assert piped[-1] < piped[0] / 2
    assert piped == pytest.approx(plain, abs=1e-3)
    assert re.search(r"ratio\s+\d+\.\d+ \(GPipe / plain\)", out)
    assert re.search(r"bubble \d+\.\d% \(ideal 33\.3%\)", out)  # n = 2, m = 2
    assert timeline.read_bytes()[:4] == b"\x89PNG"
    assert f"timeline drawn to {timeline}\n" in out  # the file written, by its name


def test_demo_of_one_step_does_not_fail_its_check_of_the_loss(tmp_path, capsys):
    # Regression: the loss of one step cannot fall below half of itself: exit status 1.
    argv = ["--quick", "--steps", "1", "--timeline", str(tmp_path / "t.png")]
    assert demo.main(argv) == 0
    assert "error" not in capsys.readouterr().err


def test_demo_rejects_bad_sizes(capsys):
    with pytest.raises(SystemExit) as raised:
        demo.parse_args(["--chunks", "0"])
    assert raised.value.code == 2
    assert "--chunks must be positive, got 0" in capsys.readouterr().err

    with pytest.raises(SystemExit):
        demo.parse_args(["--quick", "--partitions", "9"])
    assert "more than the model's 5 layers" in capsys.readouterr().err

    # Refused before any training, not at the end when the picture is drawn.
    with pytest.raises(SystemExit):
        demo.parse_args(["--quick", "--timeline", "/no/such/folder/t.png"])
    assert "no folder '/no/such/folder' to draw it in" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.parse_args(["--quick", "--timeline", "t.xyz"])
    assert "draws .png, .svg, .pdf, .jpg, .jpeg files, not .xyz" in capsys.readouterr().err

    for lr in ("-1", "0", "nan", "inf"):
        with pytest.raises(SystemExit):
            demo.parse_args(["--quick", "--lr", lr])
        assert "--lr must be a positive finite number" in capsys.readouterr().err
    for seed in (str(-(2**63) - 1), str(2**64 - 1)):  # torch's generators overflowed
        with pytest.raises(SystemExit):
            demo.parse_args(["--quick", "--seed", seed])
        assert "--seed must be from -2**63 to 2**64 - 2" in capsys.readouterr().err
    assert demo.parse_args(["--quick", "--seed", "-1"]).seed == -1  # torch takes it


def test_demo_names_the_timeline_as_it_is_drawn(tmp_path) -> None:
    # With no suffix, matplotlib draws a PNG and adds ".png": the demo says so.
    assert demo.parse_args(["--quick", "--timeline", "step"]).timeline == "step.png"
    assert demo.parse_args(["--quick", "--timeline", "step.svg"]).timeline == "step.svg"
    assert demo.parse_args(["--quick", "--timeline", "step."]).timeline == "step.png"
    hidden = str(tmp_path / ".step")  # a dot-file's name is all stem: matplotlib adds .png
    assert demo.parse_args(["--quick", "--timeline", hidden]).timeline == hidden + ".png"
    # Checked by opening it for writing: a file that exists is left as it was, and
    # none is left behind where none was.
    kept = tmp_path / "kept.png"
    kept.write_bytes(b"mine")
    assert demo.parse_args(["--quick", "--timeline", str(kept)]).timeline == str(kept)
    assert kept.read_bytes() == b"mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.png"]


@pytest.mark.parametrize("where", ["folder", "folder/", ".", "/proc/t.png"])
def test_demo_refuses_a_timeline_it_cannot_write_before_training(tmp_path, capsys, where):
    # Regression: a folder gave a file beside it (/tmp/x.png) or a hidden one in it
    # (/tmp/x/.png.png, named /tmp/x/.png); /proc/t.png failed after the training.
    if where == "/proc/t.png" and not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    (tmp_path / "folder").mkdir()
    given = where if where.startswith(("/", ".")) else str(tmp_path) + "/" + where
    with pytest.raises(SystemExit) as raised:
        demo.parse_args(["--quick", "--timeline", given])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    if where == "/proc/t.png":
        assert "--timeline '/proc/t.png': cannot write '/proc/t.png' (" in err
    else:
        assert f"--timeline {given!r}: names a folder; name a file in it, as " in err
    assert list(tmp_path.rglob("*")) == [tmp_path / "folder"]  # nothing written


def test_demo_timeline_check_leaves_links_and_refuses_what_is_no_file(
    tmp_path, capsys, monkeypatch
) -> None:
    # Regression: the check deleted a dangling link (and left its target behind, empty),
    # and blocked for ever on a named pipe.
    link = tmp_path / "link.png"
    link.symlink_to(tmp_path / "target.png")
    assert demo.parse_args(["--quick", "--timeline", str(link)]).timeline == str(link)
    assert link.is_symlink()
    assert not (tmp_path / "target.png").exists()
    pipe = tmp_path / "pipe.png"
    os.mkfifo(pipe)
    with pytest.raises(SystemExit):
        demo.parse_args(["--quick", "--timeline", str(pipe)])
    assert "is not a regular file" in capsys.readouterr().err
    # The default file, where it cannot be written, is named as the default, not as an
    # option the user never passed.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(demo, "timeline_file", _refuse)
    with pytest.raises(SystemExit):
        demo.parse_args(["--quick"])
    err = capsys.readouterr().err
    assert "the timeline's default file 'gpipe-timeline.png': refused here;" in err
    assert "--timeline '' to draw none" in err


def _refuse(name: str) -> str:
    raise ValueError("refused here")


def test_demo_help_tells_the_checkpoint_mode_of_each_preset(capsys):
    # It said "(never)", while --quick checkpoints except_last.
    with pytest.raises(SystemExit):
        demo.parse_args(["--help"])
    assert "(never; quick except_last)" in " ".join(capsys.readouterr().out.split())


def test_demo_options_override_the_preset():
    config = demo.parse_args(["--quick", "--steps", "3", "--checkpoint", "always"])
    assert (config.steps, config.checkpoint) == (3, "always")
    assert config.width == demo.parse_args(["--quick"]).width


@pytest.mark.parametrize(("num_layers", "n"), [(9, 2), (5, 4), (4, 4), (7, 3)])
def test_demo_even_balance(num_layers, n):
    balance = demo.even_balance(num_layers, n)
    assert sum(balance) == num_layers
    assert len(balance) == n
    assert max(balance) - min(balance) <= 1


def test_example_script_trains():
    out = run_python("examples/train_mlp.py")
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 6
    assert losses[-1] < losses[0] / 2


@pytest.mark.parametrize("name", ["train_mlp", "skip_unet"])
def test_example_help_explains_and_trains_nothing(name):
    # train_mlp.py and skip_unet.py took no arguments: --help started the training.
    out = run_python(f"examples/{name}.py", "--help")
    assert out.startswith(f"usage: {name}.py")
    assert "--steps" in out
    assert "loss" not in out


@pytest.mark.parametrize("name", ["train_mlp", "skip_unet", "train_gpt", "train_distributed"])
def test_example_refuses_steps_below_one(name):
    # train_gpt.py --steps 0 used to fail with UnboundLocalError after building the model.
    done = start_python(f"examples/{name}.py", "--steps", "0")
    assert done.returncode == 2, done.stderr
    assert "argument --steps: must be at least 1, got 0" in done.stderr


@pytest.mark.parametrize("name", ["train_mlp", "skip_unet"])
def test_example_options_set_the_steps_and_chunks(name):
    out = run_python(f"examples/{name}.py", "--steps", "1", "--chunks", "2")
    assert re.findall(r"step +(\d+) +loss", out) == ["1"]  # the last step is always shown


def test_benchmark_quick_writes_json_and_tables(tmp_path):
    out_file = tmp_path / "results.json"
    out = run_python("benchmarks/pipeline_speed/main.py", "--quick", "--out", str(out_file))
    assert "Sleep layers" in out
    assert "Overhead" in out
    results = json.loads(out_file.read_text())
    cells = {(row["n"], row["m"]) for row in results["sleep"]}
    assert cells == {(1, 1), (1, 4), (2, 1), (2, 4)}
    for row in results["sleep"]:
        assert row["forward_s"] > 0
        assert row["bound_s"] == pytest.approx((row["m"] + row["n"] - 1) * 1e-3)
    for row in results["sleep"]:
        assert row["forward_over_bare"] > 0
        assert row["no_grad_over_bare"] > 0
    modes = {(row["n"], row["m"], row["mode"]) for row in results["overhead"]}
    assert len(modes) == 12  # eval, train and step, for each (n, m)
    assert results["environment"]["torch"] == __import__("torch").__version__


@pytest.mark.parametrize(
    ("option", "said"),
    [
        ("--out", "is a folder; name a file in it"),
        ("--partitions", "argument --partitions: 0 is not at least 1"),
        ("--sleep-ms", "is not a finite number above 0"),
    ],
)
def test_benchmarks_refuse_bad_options_before_measuring(tmp_path, option, said):
    # A folder as --out was found when the JSON was written, after the whole run; a count
    # of 0 failed somewhere inside. (Apart, so that the workers share the processes.)
    value = {"--out": str(tmp_path), "--partitions": "0", "--sleep-ms": "nan"}[option]
    done = start_python("benchmarks/schedules/main.py", "--quick", option, value)
    assert done.returncode == 2, done.stderr
    assert said in done.stderr
    assert "Traceback" not in done.stderr


def test_benchmarks_refuse_bad_files_before_measuring(tmp_path):
    done = start_python("benchmarks/transparency/main.py", "--quick", "--plot", "loss.xyz")
    assert "draw to one of .png" in done.stderr
    same = str(tmp_path / "same.png")  # the picture would have replaced the results
    done = start_python("benchmarks/transparency/main.py", "--quick", "--out", same, "--plot", same)
    assert "--out and --plot name one file" in done.stderr
    done = start_python("benchmarks/memory/main.py", "--quick", "--partitions", "0")  # shared
    assert "argument --partitions: 0 is not at least 1" in done.stderr


def test_a_benchmark_makes_the_folders_of_out_only_once_it_measures(tmp_path):
    # --quick replaced the sizes given with its own.
    deep = str(tmp_path / "deep" / "er" / "results.json")
    done = start_python("benchmarks/schedules/main.py", "--out", deep, "--partitions", "0")
    assert done.returncode == 2
    assert not (tmp_path / "deep").exists()  # what the check of --out made is removed again
    out_file = tmp_path / "deep" / "results.json"  # its folders made, as at the end
    run_python("benchmarks/schedules/main.py", "--quick", "--repeats", "2", "--out", str(out_file))
    parameters = json.loads(out_file.read_text())["parameters"]
    assert (parameters["repeats"], parameters["partitions"]) == (2, [2])  # given, quick's


def test_noise_benchmark_quick_times_the_bare_pipeline_against_itself(tmp_path):
    out_file = tmp_path / "noise.json"
    out = run_python("benchmarks/pipeline_speed/noise.py", "--quick", "--out", str(out_file))
    assert "against itself" in out
    (row,) = json.loads(out_file.read_text())["rows"]
    assert (row["n"], row["m"]) == (2, 2)
    assert set(row["ratios"]) == {"0.0", "50.0"}
    assert all(ratio > 0 for ratio in row["ratios"].values())


def test_cpu_compute_benchmark_quick_compares_every_path(tmp_path):
    out_file = tmp_path / "compute.json"
    out = run_python("benchmarks/cpu_compute/main.py", "--quick", "--out", str(out_file))
    assert "model(x)/GPipe" in out
    rows = json.loads(out_file.read_text())["rows"]
    assert [row["checkpoint"] for row in rows] == ["never", "except_last", "always"]
    for row in rows:
        for path in ("model(x)", "engine", "ScheduleGPipe", "Schedule1F1B", "model(x)/GPipe"):
            assert row[path] > 0


def test_materialize_benchmark_quick_measures_both_ways(tmp_path):
    out_file = tmp_path / "materialize.json"
    run_python("benchmarks/materialize/main.py", "--quick", "--out", str(out_file))
    results = json.loads(out_file.read_text())
    assert set(results["rows"]) == {"whole", "meta"}
    for rows in results["rows"].values():
        assert [row["rank"] for row in rows] == [0, 1]
        assert all(row["share"] > 0 for row in rows)


def test_gpt_example_trains_split_stages_like_the_plain_model():
    out = run_python("examples/train_gpt.py", "--steps", "6", "--stages", "2", "--chunks", "2")
    rows = re.findall(r"loss plain (\d+\.\d+)  GPipe (\d+\.\d+)  1F1B (\d+\.\d+)", out)
    assert len(rows) == 3  # steps 1, 5 and 6
    for plain, piped, stepped in rows:
        assert float(piped) == pytest.approx(float(plain), abs=1e-3)
        assert float(stepped) == pytest.approx(float(plain), abs=1e-3)
    assert float(rows[-1][0]) < float(rows[0][0])
    assert "tied copies equal after training: True" in out
    assert "state dict loads into the plain model: True" in out


def test_gpt_example_refuses_more_stages_than_the_model_has():
    done = start_python("examples/train_gpt.py", "--stages", "50", "--steps", "1")
    assert done.returncode == 2, done.stderr
    assert "--stages 50: cannot cut GPT into 50 stages" in done.stderr


def test_gpt_example_finds_the_tied_weights_in_any_stage():
    # With 15 stages or more the first holds no layer of the model (the token embedding
    # is in stage 1): the script trained, then failed on m[0].tokens.
    out = run_python("examples/train_gpt.py", "--steps", "1", "--stages", "16", "--chunks", "1")
    assert "tied copies equal after training: True" in out


def test_skip_example_trains_and_prints_the_layout():
    out = run_python("examples/skip_unet.py")
    assert re.search(r"'skip' in Namespace\('level 1'\) +0 +2", out)
    assert re.search(r"'skip' in Namespace\('level 2'\) +0 +1", out)
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 3
    assert losses[-1] < losses[0] / 2


def test_split_benchmark_quick_times_both_models_and_the_split(tmp_path):
    out_file = tmp_path / "split.json"
    out = run_python("benchmarks/split/main.py", "--quick", "--out", str(out_file))
    assert re.search(r"split / by hand: \d+\.\d{3}", out)
    results = json.loads(out_file.read_text())
    assert len(results["speed"]["ratios"]) == 3
    assert results["split"]["at_names_s"] > 0


def test_skip_benchmark_quick_counts_one_crossing(tmp_path):
    out_file = tmp_path / "skip.json"
    run_python("benchmarks/skip_traffic/main.py", "--quick", "--out", str(out_file))
    rows = json.loads(out_file.read_text())["rows"]
    crossings = {(row["kind"], row["n"]): row["skip_crossings"] for row in rows}
    back = {(row["kind"], row["n"]): row["skip_backward_crossings"] for row in rows}
    assert back == crossings  # each gradient crosses back where its tensor crossed
    assert crossings == {
        ("skippable", 2): 1.0,
        ("tuple", 2): 1.0,
        ("skippable", 4): 1.0,
        ("tuple", 4): 3.0,
    }


def test_balance_benchmark_quick_compares_three_splits(tmp_path):
    out_file = tmp_path / "balance.json"
    out = run_python("benchmarks/balance/main.py", "--quick", "--out", str(out_file))
    assert "balance_by_time" in out
    rows = {row["balance_name"]: row for row in json.loads(out_file.read_text())["rows"]}
    assert set(rows) == {"even", "balance_by_time", "brute force"}
    for row in rows.values():
        assert sum(row["balance"]) == 17
        assert row["forward_ms"] > 0
    # The brute force is the best by construction; nothing beats it.
    assert all(
        rows["brute force"]["slowest_ms"] <= row["slowest_ms"] + 1e-9 for row in rows.values()
    )


def test_speed_benchmark_quick_measures_naive_and_pipelines(tmp_path):
    out_file, figure = tmp_path / "speed.json", tmp_path / "speed.png"
    out = run_python(
        "benchmarks/speed/main.py", "--quick", "--out", str(out_file), "--plot", str(figure)
    )
    assert "Speed-up" in out
    rows = json.loads(out_file.read_text())["rows"]
    seen = {(row["model"], row["experiment"]) for row in rows}
    for model in ("resnet101", "amoebanetd", "unet"):
        assert {(model, "naive-1"), (model, "pipeline-1"), (model, "pipeline-2")} <= seen
    assert {("amoebanetd", "n=2, m=1"), ("amoebanetd", "n=2, m=4")} <= seen  # the grid
    for row in rows:
        assert row["throughput"] > 0
        if row["balance"] is not None:
            assert len(row["balance"]) == row["k"]
    assert figure.read_bytes()[:4] == b"\x89PNG"


def test_transparency_benchmark_quick_agrees(tmp_path):
    out_file = tmp_path / "transparency.json"
    run_python("benchmarks/transparency/main.py", "--quick", "--out", str(out_file))
    results = json.loads(out_file.read_text())
    assert len(results["rows"]) == 3  # chunks=2 x three checkpoint modes
    for row in results["rows"]:
        assert row["max_abs"] < 1e-9  # five float64 steps: rounding only
    assert len(results["curves"]["plain"]) == 5


def test_memory_benchmark_quick_validates_its_method(tmp_path):
    out_file, figure = tmp_path / "memory.json", tmp_path / "memory.png"
    run_python(
        "benchmarks/memory/main.py", "--quick", "--out", str(out_file), "--plot", str(figure)
    )
    assert figure.read_bytes()[:4] == b"\x89PNG"
    results = json.loads(out_file.read_text())
    assert results["validation"]["measured"] == results["validation"]["expected"]
    rows = {(row["model"], row["experiment"]): row for row in results["rows"]}
    for model in ("resnet101", "amoebanetd", "unet"):
        naive = max(rows[(model, "naive-1")]["activation_bytes"].values())
        piped = max(rows[(model, "pipeline-1")]["activation_bytes"].values())
        assert 0 < piped < naive  # checkpointing keeps less than the plain model


def test_schedules_benchmark_quick_measures_every_schedule_and_the_reference(tmp_path):
    out_file = tmp_path / "results.json"
    out = run_python("benchmarks/schedules/main.py", "--quick", "--out", str(out_file))
    assert "simulated makespan" in out
    rows = json.loads(out_file.read_text())["rows"]
    names = {row["schedule"] for row in rows}
    assert names == {
        "GPipe",
        "1F1B",
        "interleaved-1F1B",
        "ZB-H1",
        "torch ScheduleGPipe",
        "torch Schedule1F1B",
    }
    for row in rows:
        assert row["step_s"] > 0
        assert row["makespan_s"] > 0
        if "peak_held" in row:
            assert row["peak_held"] == row["simulated_held"]


@pytest.mark.distributed
def test_distributed_example_trains_on_two_processes():
    out = run_python("examples/train_distributed.py", "--processes", "2", "--steps", "7")
    # Printed by rank 0 only, every 5 steps and the last (which was left out).
    steps = re.findall(r"step +(\d+) +loss", out)
    assert steps == ["5", "7"]
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    ("processes", "error"),
    [
        ("0", "argument --processes: must be at least 1, got 0"),
        ("6", "6 processes, but the model has 5 layers and each process runs at least one"),
    ],
    ids=["none", "more-than-layers"],
)
def test_distributed_example_refuses_processes_it_cannot_fill(processes, error):
    # Refused before any process starts: --processes 0 printed nothing and exited 0;
    # more processes than layers failed in every process with a BalanceError (and six to
    # eight, each one layer of the old eight, gave a ReLU alone nothing to train).
    done = start_python("examples/train_distributed.py", "--processes", processes)
    assert done.returncode == 2, done.stderr
    assert error in done.stderr


@pytest.mark.distributed
def test_distributed_benchmark_quick_measures_every_schedule_and_the_reference(tmp_path):
    out_file = tmp_path / "results.json"
    out = run_python("benchmarks/distributed/main.py", "--quick", "--out", str(out_file))
    assert "simulated makespan" in out
    rows = json.loads(out_file.read_text())["rows"]
    assert {row["schedule"] for row in rows} == {
        "GPipe",
        "GPipe static",
        "1F1B",
        "1F1B static",
        "interleaved-1F1B",
        "ZB-H1",
        "torch ScheduleGPipe",
        "torch Schedule1F1B",
    }
    for row in rows:
        assert row["step_s"] > 0
        assert row["over_makespan"] == pytest.approx(row["step_s"] / row["makespan_s"])
        if not row["schedule"].startswith("torch"):
            assert row["reference"].startswith("torch")
            assert row["over_reference"] > 0


def _benchmark_module(folder: str, name: str) -> Any:
    """Import ``benchmarks/<folder>/<name>.py`` as the scripts themselves run it."""
    for path in (ROOT / "benchmarks", ROOT / "benchmarks" / folder):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    return importlib.import_module(name)


def test_gpu_timeline_counts_copy_time_under_kernels_of_other_streams(tmp_path):
    timeline = _benchmark_module("gpu", "timeline")
    trace = tmp_path / "trace.json"
    copy = "Memcpy HtoD (Pinned -> Device)"
    trace.write_text(
        json.dumps(
            {
                "traceEvents": [
                    {"cat": "kernel", "name": "a", "ts": 0, "dur": 100, "args": {"stream": 7}},
                    {"cat": "kernel", "name": "b", "ts": 150, "dur": 100, "args": {"stream": 7}},
                    {"cat": "kernel", "name": "c", "ts": 60, "dur": 20, "args": {"stream": 9}},
                    {"cat": "kernel", "name": "d", "ts": 60, "dur": 100, "args": {"stream": 13}},
                    {"cat": "gpu_memcpy", "name": copy, "ts": 50, "dur": 200,
                     "args": {"stream": 13}},
                    {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5},
                ]
            }
        )
    )  # fmt: skip
    events = timeline.gpu_events(trace)
    assert [e["kind"] for e in events] == ["kernel"] * 4 + ["copy"]
    # Copy 50-250 under kernels of streams 7 and 9: 50-100 and 150-250 (the kernel of
    # its own stream 13 does not count, and 60-80 is counted once).
    assert timeline.copy_overlap(events) == pytest.approx(150 / 200)


def test_unet_has_the_sizes_of_the_papers_table():
    unet = _benchmark_module("models", "models.unet").unet
    import torch

    for (units, channels), parameters in {(6, 72): 362_157_516, (11, 128): 2_213_834_176}.items():
        with torch.device("meta"):
            model = unet(units, channels)
        assert sum(p.numel() for p in model.parameters()) == parameters

"""Where torchgpipe's automatic balancing lived in its first releases.

Importing this module fails with a message that names the module to use instead.
"""

raise ImportError(
    "torchgpipe_balancing is gone: its functions live in torchgpipe.balance now, "
    "such as 'from torchgpipe.balance import balance_by_time'"
)

"""Where torchgpipe's automatic balancing lived before torchgpipe 0.0.7.

Importing this module fails with a message that names the module to use instead.
"""

raise ImportError(
    "torchgpipe_balancing is gone (since torchgpipe 0.0.7): import the same functions "
    "from torchgpipe.balance, such as 'from torchgpipe.balance import balance_by_time'"
)

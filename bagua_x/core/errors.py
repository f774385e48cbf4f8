"""The one exception type bagua_x raises for user-facing mistakes and faults.

A single base class lets users catch every bagua_x error in one place while
each message still names the tensor, leaf or setting concerned.
"""


class BaguaXError(RuntimeError):
    """A bagua_x error: the message says what was wrong and what to do."""

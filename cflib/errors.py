"""User-facing errors shared across the layers: each message names the thing at fault."""


class ParamError(ValueError):
    """A parameter set that cannot run; the message names the parameter."""

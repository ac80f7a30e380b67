"""User-facing errors shared across the layers: each message names the thing at fault."""


class ParamError(ValueError):
    """A parameter set that cannot run; the message names the parameter."""


class KernelUnavailable(ParamError):
    """A required fast path cannot run here; the message says which check failed."""

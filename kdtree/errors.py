"""The one exception family users see: a single line naming the input, the value and the fix."""


class KdtreeError(Exception):
    """Base of every error kdtree reports to a user (printed as one line, no traceback)."""


class ConfigError(KdtreeError):
    """A composed config that cannot run: a key, its value, and what would be valid."""


class CheckpointError(KdtreeError):
    """A checkpoint that cannot be loaded: the file, the tensor, and what was expected."""


class PipelineError(KdtreeError):
    """A pipeline spec or stage failure: the pipeline, the stage, and why."""


class HostError(KdtreeError):
    """A host that cannot be reached or refused a command: the address and the reason."""


class NativeError(KdtreeError):
    """The native library reported an error (its message is carried verbatim)."""


class CachePoolBusy(NativeError):
    """The reserved latent-cache pool has no free range of the rows asked for right now (others hold it); the
    request can run once running sequences finish."""

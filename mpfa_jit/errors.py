"""Errors of the kernel service. Each says what was asked, what is accepted, and what to do."""


class MpfaJitError(RuntimeError):
    """Base class of every error the kernel service raises."""


class NvccNotFoundError(MpfaJitError):
    pass


class UnsupportedArchError(MpfaJitError):
    pass


class UnknownKernelError(MpfaJitError, ValueError):
    """No kernel family or specialization of that name and parameters exists."""


class BuildError(MpfaJitError):
    """nvcc or ninja failed; the message carries the end of the compiler's log."""


class KernelAbiError(MpfaJitError):
    """A built library's params struct differs from the ctypes mirror of its op module."""


class KernelLaunchError(MpfaJitError):
    """A compiled kernel returned a CUDA error."""


class CacheDirError(MpfaJitError):
    """The kernel cache folder (MPFA_CACHE_DIR) cannot be used: it cannot be written, or one of its folders is a
    symbolic link out of it. The message names the folder and what failed, in one line."""


class NotACacheError(CacheDirError):
    """The cache directory holds files that are not mpfa's: nothing there is built into or deleted."""

"""User-facing errors: the command line prints them without a traceback and exits with status 2."""


class MambaDebugError(Exception):
    """A problem with the user's input (file, flag, plug-in) that they can fix; the message says how."""


class CheckpointError(MambaDebugError):
    """A model file or folder that cannot be loaded as it is."""


class PluginError(MambaDebugError):
    """A kernel plug-in that cannot be loaded, or whose op misbehaved at run time."""

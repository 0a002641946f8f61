"""User-facing errors: one line that says what is wrong and how to fix it."""


class TrtServeError(Exception):
    """An error caused by input the user can correct. The CLI prints it and exits with 2."""

    exit_code = 2


class ModelSourceError(TrtServeError):
    """The model argument cannot be resolved or its files are unusable."""


class EngineDirError(TrtServeError):
    """An engine directory is missing, incomplete, corrupt or built for something else."""


class InputError(TrtServeError):
    """Feeds given to a backend do not match the engine's inputs or shape ranges."""

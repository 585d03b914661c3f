"""User-facing errors: one clear line, never a traceback."""


class LabError(Exception):
    """A mistake the user can fix (bad input, missing GPU, unwritable folder...).

    The CLI prints `lab: <message>` and exits non-zero; nothing else is printed.
    """

    exit_code = 2


class RecordError(LabError):
    """A result record that does not match the schema, or could not be written."""


class Skip(LabError):
    """Raised inside an exercise when this machine cannot run it (missing data, an unsupported
    backend, too few GPUs): the record says 'skipped' with this reason, never 'failed'."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler's stop), raised in the main thread so that every `finally` runs:
    child processes are killed and temporary files removed before `lab` exits."""

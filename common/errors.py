"""User-facing errors: one clear line, never a traceback."""


class LabError(Exception):
    """A mistake the user can fix (bad input, missing GPU, unwritable folder...).

    The CLI prints `lab: <message>` and exits non-zero; nothing else is printed.
    """

    exit_code = 2


class RecordError(LabError):
    """A result record that does not match the schema, or could not be written."""

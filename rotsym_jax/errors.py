"""The one base of every error rotsym_jax raises for bad input (`RotsymError`), so that a caller
catches the library's refusals with one clause and lets real bugs through. Each module's error
(SpecError, CheckpointError, StreamingError, ...) derives from it and from the builtin a caller
would expect: ValueError for bad input, RuntimeError for another process's failure (ProcessError)."""


class RotsymError(Exception):
    """A refusal of rotsym_jax: its message names the input, what was found and what was expected."""


class InputError(RotsymError, ValueError):
    """An argument, option or input outside what a function accepts (the module errors below say
    which input: a spec, a checkpoint, a recipe, data, statistics, a streamed run, a pipeline)."""


class InputTypeError(RotsymError, TypeError):
    """An argument of the wrong type (a mapping where a list is expected, a bool for a number)."""


class MissingPath(RotsymError, FileNotFoundError):
    """A checkpoint folder or file that is not there."""


class PathExists(RotsymError, FileExistsError):
    """An output path that exists already, or may not be written to (inside an input, a link)."""

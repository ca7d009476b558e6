"""The one error a bad model file raises."""

from pathlib import Path


class ModelFileError(ValueError):
    """A model file that cannot be read, or that describes a model tokenspeed cannot run.

    A ``ValueError`` so that callers (the CLI prints these as one line) treat it as bad
    input; the message starts with the file, so the one line says where to look.
    """

    def __init__(self, file, problem: str):
        super().__init__(f"{file}: {problem}")
        self.file, self.problem = Path(file), problem

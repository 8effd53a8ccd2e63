"""The export's own error for a checkpoint it cannot load faithfully."""


class CheckpointError(Exception):
    """A checkpoint we cannot load faithfully; the message names the file and the tensor."""

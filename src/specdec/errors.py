"""The one exception type users see; the CLI prints its message without a traceback."""


class SpecdecError(ValueError):
    pass

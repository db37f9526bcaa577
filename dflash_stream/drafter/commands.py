"""Placeholder: replaced by the part's owner."""


def register(sub) -> None:
    pass

"""Checks of what the backend receives: ranks agree before the first collective (``ranks``) and
each call's inputs match the token layout the compile assumed (``inputs``)."""

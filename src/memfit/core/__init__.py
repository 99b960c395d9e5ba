"""Units, precisions, memory categories and the user-error type shared by all of memfit."""

"""The pinned contract and the names on the wire: models, validation, errors, encodings.

Pure: nothing here does I/O.
"""

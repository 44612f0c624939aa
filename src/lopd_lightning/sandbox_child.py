"""Deprecated: the sandbox's child program is now the package :mod:`lopd_lightning.sandbox.child` (run by path,
``.../sandbox/child/__main__.py``), its plain-data codec :mod:`lopd_lightning.sandbox.child.codec`.

The names of this module keep working for one release; the first use of each warns once (``FutureWarning``)
with its new home.
"""

from lopd_lightning.deprecation import moved_names

__getattr__ = moved_names(
    __name__,
    {
        "SETUP_FAILED_EXIT": "lopd_lightning.sandbox.child:SETUP_FAILED_EXIT",
        "PROTOCOL_EXIT": "lopd_lightning.sandbox.child:PROTOCOL_EXIT",
        "MAX_DEPTH": "lopd_lightning.sandbox.child.codec:MAX_DEPTH",
        "MAX_ITEMS": "lopd_lightning.sandbox.child.codec:MAX_ITEMS",
        "MAX_LINE": "lopd_lightning.sandbox.child.codec:MAX_LINE",
        "NotPlainData": "lopd_lightning.sandbox.child.codec:NotPlainData",
        "encode": "lopd_lightning.sandbox.child.codec:encode",
        "decode": "lopd_lightning.sandbox.child.codec:decode",
        "from_json": "lopd_lightning.sandbox.child.codec:from_json",
        "main": "lopd_lightning.sandbox.child.main:main",
    },
)

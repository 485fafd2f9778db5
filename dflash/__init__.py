"""dflash: the library behind the dflash-pipeline stages (audit, generate, tokenize, train, eval, plan)."""

__version__ = "0.1.0"

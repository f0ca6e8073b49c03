"""The command line: ``strata`` (entry.py, main.py), ``strata chat`` (chat.py), ``strata bench`` (bench.py),
``strata make-model`` (make_model.py); the flags they share and how they resolve settings (flags.py)."""

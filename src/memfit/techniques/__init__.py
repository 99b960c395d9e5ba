"""Memory techniques: one module per family, each a config registered by name (base.py), composed in one
canonical order with one table of combinations that do not work (compose.py).

    import memfit
    setup = memfit.apply_(model, optimizer, ["bf16-mixed", "checkpointing", "adamw8bit"])
"""

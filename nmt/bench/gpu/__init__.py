"""The GPU check of ``scripts/gpu_check.py`` (whose docstring says what each part measures):
``check`` runs the parts within one deadline and ``report`` writes their markdown; a module per
part: ``env`` (1, and the data), ``training`` (2-3, timed by ``recorder``'s ``StepRecorder``),
``sdpa`` (4), ``checkpointing`` (5), ``kv_cache`` (6) and ``parity`` (7)."""

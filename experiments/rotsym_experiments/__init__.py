"""The models and tasks the experiments, the notebooks and `rotsym demo` train, on top of
rotsym_jax's public API; installed with `pip install 'rotsym_jax[experiments]'`.

    training    the training loop (AdamW, one jitted scan per epoch) and the trained-model cache
    digits      small ViTs on scikit-learn's digits (the demo's models)
    demo        `rotsym demo`: two of them trained, aligned (weights, activations, learned) and merged
    textcls     generated review-sentiment tasks and fine-tunes of the pretrained MiniLM
    seqtask     a synthetic next-token task and small GPT-2 / Llama decoders trained on it
    results_io  where a result comes from, atomic JSON, and the tables of the RESULTS.md files

Import the modules themselves (`from rotsym_experiments import digits`): this package imports
nothing on its own, so `results_io` needs neither scikit-learn nor the models.
"""

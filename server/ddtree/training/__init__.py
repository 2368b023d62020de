"""Training for the demo pair and for new drafters: `ddtree train-target` and `ddtree train-draft`.

`corpus` reads local text into token streams with a deterministic held-out split, `tokenizer` builds the
byte-level BPE of the demo target, `target` trains a small Qwen3 causal LM, and `drafter` trains a DFlash
drafter against any frozen transformers target with the same module the engine decodes with.
"""

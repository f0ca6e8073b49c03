"""The model on the coordinator's device side.

decoder.py   Decoder: embedding, attention with a KV cache, MoE (route, pool, device experts), lm_head
ops.py       the array operations (NumPy or CuPy), kv_cache.py the per-sequence KV cache
weights.py   the dense weights and expert tensor references, model_config.py config.json per architecture
sampling.py  temperature / top-k / top-p sampling (its parameters: sampling_params.py), tokenizer.py text <-> ids
chat_template.py  the model's chat template, source.py a model's checkpoint, config, tokenizer and template
xp.py        the array module (NumPy or CuPy), host staging and the side stream; backend.py picks the device
"""

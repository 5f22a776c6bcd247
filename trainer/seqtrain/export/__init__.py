"""Weights in and out: Hugging Face Llama folders and seqtrain's own safetensors format.

- `weights.load_source(path)` reads any weight source (run folder, checkpoint of any engine/layout, a seqtrain
  export, a Hugging Face Llama folder) as (ModelSpec, full single-process state dict, tokenizer info).
- `hf` maps seqtrain's GPT to `LlamaForCausalLM` names and config (and back).
- `writer.export(...)` writes an export folder; `seqtrain export` is its command line.
"""

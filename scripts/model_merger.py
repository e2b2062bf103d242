"""Merge an mmrl checkpoint role folder into a Hugging Face model folder (safetensors).

    python scripts/model_merger.py --local_dir checkpoints/<project>/<experiment>/global_step_N/actor \
        [--target_dir DIR] [--dtype auto|float32|bfloat16|float16]

The output (default: <local_dir>/huggingface, next to the copied tokenizer and processor files) loads
with ``from_pretrained`` and vLLM. Runs in one process on CPU; see mmrl/checkpoint/merger.py.
"""

from mmrl.checkpoint.merger import main

if __name__ == "__main__":
    main()

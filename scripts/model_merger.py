"""Merge an mmrl checkpoint role folder into a Hugging Face model folder (safetensors).

    python scripts/model_merger.py --local_dir checkpoints/<project>/<experiment>/global_step_N/actor \
        [--target_dir DIR] [--dtype auto|float32|bfloat16|float16] [--adapter] [--base_model DIR]

The output (default: <local_dir>/huggingface, next to the copied tokenizer and processor files) loads
with ``from_pretrained`` and vLLM. A LoRA checkpoint is merged into its base model (the run's, or
--base_model); --adapter writes the PEFT adapter instead (loads with ``peft.PeftModel.from_pretrained``). Runs in one process on CPU; see mmrl/checkpoint/merger.py.
"""

from mmrl.checkpoint.merger import main

if __name__ == "__main__":
    main()

"""Multi-LoRA serving: PEFT adapters over one base model, mixed per row in one batch
(Punica, Chen et al. 2023; S-LoRA, Sheng et al. 2023; vLLM's ``vllm/lora/``)."""

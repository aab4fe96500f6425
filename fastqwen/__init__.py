"""fastqwen: Hugging Face Qwen3.5/3.6 generation at the GPU's memory-bandwidth limit.

    model = fastqwen.optimize(model, max_batch_size=1, max_seq_len=4096)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=512)
"""

from .optimize import optimize
from .quant.checkpoints import from_pretrained, save_pretrained

__version__ = "0.1.0"
__all__ = ["optimize", "from_pretrained", "save_pretrained", "__version__"]

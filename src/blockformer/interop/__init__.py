"""Other formats: Hugging Face checkpoints in and out, one small key map per family.

``from_hf(dir_or_model)`` imports GPT-2, Llama/Mistral, BERT, T5, BART and Marian;
``to_hf(checkpoint_or_model, out)`` writes any blockformer model whose config one of them
can express. ``to_peft``/``from_peft`` move LoRA adapters to and from PEFT's format
(GPT-2, Llama, BERT). ``blockformer convert`` is the command-line form.
"""

from .convert import Imported, from_hf, to_hf
from .peft import ImportedAdapter, from_peft, to_peft
from .rules import half_to_interleaved, interleaved_to_half

__all__ = ["Imported", "ImportedAdapter", "from_hf", "to_hf", "from_peft", "to_peft", "half_to_interleaved",
           "interleaved_to_half"]

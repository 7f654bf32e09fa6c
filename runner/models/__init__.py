"""The models: families (one module each), the torchtune and transformers backends behind one
interface, the tokenizer and chat template, checkpoint files, and the one torchtune boundary."""

"""Continue a few text prompts, as Meta's example does, with a KV-cache switch.

    python example_text_completion.py [--ckpt_dir DIR | -m FILE.gguf] [--no-kv-cache]
    torchrun --nproc_per_node 2 example_text_completion.py --ckpt_dir DIR   # model parallel

Without --ckpt_dir (or -m) it uses the default model (fetched on first use); a .gguf file or a Hugging Face
folder is converted once into $LLAMA_HOME/converted.
"""

from llama.cli import build, run

PROMPTS = [
    "I believe the meaning of life is",
    "The three primary colors are",
    "Here is a short poem about the sea:\n",
    "Translate to French: cheese =>",
]


def main(
    ckpt_dir: str = None,
    tokenizer_path: str = None,
    temperature: float = 0.6,
    top_p: float = 0.9,
    max_seq_len: int = 128,
    max_gen_len: int = 64,
    max_batch_size: int = 4,
    no_kv_cache: bool = False,
    quantize: str = None,
    model: str = None,
):
    """Continue four example prompts and print each continuation.

    Args:
        ckpt_dir: a checkpoint directory in Meta's layout (params.json, consolidated.NN.pth), a .gguf file
            or a Hugging Face LLaMA folder (converted once into $LLAMA_HOME/converted); default: the
            default model, fetched on first use.
        tokenizer_path: tokenizer file; default: the one in (or beside) the checkpoint directory.
        temperature: sampling temperature; 0 is greedy.
        top_p: nucleus-sampling threshold.
        max_seq_len: the most tokens a prompt plus its continuation may use.
        max_gen_len: the most new tokens per prompt.
        max_batch_size: the most prompts in one batch.
        no_kv_cache: feed the whole prefix every step instead of caching keys and values.
        quantize: int8 or int4: hold the linear layers' weights quantized (see llama-generate --help).
        model: the same as --ckpt-dir, by llama.cpp's name (-m FILE).
    """
    generator = build(
        ckpt_dir=ckpt_dir,
        model=model,
        tokenizer_path=tokenizer_path,
        max_seq_len=max_seq_len,
        max_batch_size=max_batch_size,
        quantize=quantize,
    )
    results = generator.text_completion(PROMPTS, temperature=temperature, top_p=top_p, max_gen_len=max_gen_len,
                                        kv_cache=not no_kv_cache)
    for prompt, result in zip(PROMPTS, results):
        print(prompt)
        print(f"> {result['generation']}")
        print("\n==================================\n")


if __name__ == "__main__":
    run(main)

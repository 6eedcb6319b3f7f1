"""Answer a few example dialogs, as Meta's example does, with a KV-cache switch.

    python example_chat_completion.py [--ckpt_dir DIR | -m FILE.gguf] [--no-kv-cache]
    torchrun --nproc_per_node 2 example_chat_completion.py --ckpt_dir DIR   # model parallel

Without --ckpt_dir (or -m) it uses the default model (fetched on first use); a .gguf file or a Hugging Face
folder is converted once into $LLAMA_HOME/converted.
"""

from llama.cli import build, run

DIALOGS = [
    [{"role": "user", "content": "What is the boiling point of water at sea level, in Celsius?"}],
    [
        {"role": "user", "content": "Name a fruit that is yellow."},
        {"role": "assistant", "content": "A banana."},
        {"role": "user", "content": "And one that is red?"},
    ],
    [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
]


def main(
    ckpt_dir: str = None,
    tokenizer_path: str = None,
    temperature: float = 0.6,
    top_p: float = 0.9,
    max_seq_len: int = 512,
    max_gen_len: int = None,
    max_batch_size: int = 4,
    no_kv_cache: bool = False,
    quantize: str = None,
    model: str = None,
):
    """Reply to three example dialogs and print each exchange.

    Args:
        ckpt_dir: a checkpoint directory in Meta's layout (params.json, consolidated.NN.pth), a .gguf file
            or a Hugging Face LLaMA folder (converted once into $LLAMA_HOME/converted); default: the
            default model, fetched on first use.
        tokenizer_path: tokenizer file; default: the one in (or beside) the checkpoint directory.
        temperature: sampling temperature; 0 is greedy.
        top_p: nucleus-sampling threshold.
        max_seq_len: the most tokens a dialog plus its reply may use.
        max_gen_len: the most tokens per reply; default: up to max_seq_len.
        max_batch_size: the most dialogs in one batch.
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
    results = generator.chat_completion(DIALOGS, temperature=temperature, top_p=top_p, max_gen_len=max_gen_len,
                                        kv_cache=not no_kv_cache)
    for dialog, result in zip(DIALOGS, results):
        for msg in dialog:
            print(f"{msg['role'].capitalize()}: {msg['content']}\n")
        print(f"> {result['generation']['role'].capitalize()}: {result['generation']['content']}")
        print("\n==================================\n")


if __name__ == "__main__":
    run(main)

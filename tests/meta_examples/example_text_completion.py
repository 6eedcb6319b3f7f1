"""The calls of Meta's LLaMA-2 `example_text_completion.py`, as a script written for Meta's package makes them.

Test data, run unmodified under torchrun by tests/test_meta_compat.py: the same imports, command-line
flags and defaults, `Llama.build` and `text_completion` arguments and printing as Meta's script; the
prompts are this project's own.
"""

import fire

from llama import Llama


def main(
    ckpt_dir: str,
    tokenizer_path: str,
    temperature: float = 0.6,
    top_p: float = 0.9,
    max_seq_len: int = 128,
    max_gen_len: int = 64,
    max_batch_size: int = 4,
):
    generator = Llama.build(
        ckpt_dir=ckpt_dir,
        tokenizer_path=tokenizer_path,
        max_seq_len=max_seq_len,
        max_batch_size=max_batch_size,
    )

    prompts = [
        # Continuations.
        "The old lighthouse keeper climbed the stairs and",
        "In one sentence, photosynthesis is ",
        # A letter to finish, over several lines.
        """A short note to a neighbour about a lost cat:

        Dear Sam,

        Have you """,
        # A few examples, then one to complete.
        """Give the plural:

        mouse => mice
        child => children
        goose =>""",
    ]
    results = generator.text_completion(
        prompts,
        max_gen_len=max_gen_len,
        temperature=temperature,
        top_p=top_p,
    )
    for prompt, result in zip(prompts, results):
        print(prompt)
        print(f"> {result['generation']}")
        print("\n==================================\n")


if __name__ == "__main__":
    fire.Fire(main)

"""Offline batch generation with pagoda's Python API.

    python examples/offline_generate.py                 # the embedded SmolLM2-135M-Instruct
    python examples/offline_generate.py path/to/model   # any supported HF directory or .gguf
"""

import sys

from pagoda import LLM, SamplingParams


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else None
    llm = LLM(model=model, config_file="examples/engine.yaml", device="cpu")
    prompts = ["The capital of France is", "Three primary colours are", "def fibonacci(n):"]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    for out in llm.generate(prompts, greedy):
        print(repr(out.prompt), "->", repr(out.outputs[0].text))
    creative = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=7, n=2)
    for completion in llm.generate(["Once upon a time"], creative)[0].outputs:
        print("sample", completion.index, repr(completion.text))
    chat = llm.chat([{"role": "user", "content": "Name a large city in Japan."}], greedy)
    print("chat ->", repr(chat[0].outputs[0].text))
    print(llm.get_stats())


if __name__ == "__main__":
    main()

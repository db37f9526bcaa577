"""Rows in the published layouts of the headline config's six sources (configs/qwen3.6-27b-4gpu.yaml), written
from the dataset cards' schemas with our own content (no dataset content is copied), and a Qwen3.5-family chat
template. `python tests/published_rows.py FOLDER` writes the files and a config for `dflash-stream data`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HEADLINE = Path(__file__).resolve().parents[1] / "configs" / "qwen3.6-27b-4gpu.yaml"

# A Qwen3.5/3.6-style template: ChatML turns, tools listed in the system turn, XML-style tool calls, tool
# responses inside a user turn, and a generation prompt that opens <think> unless enable_thinking is false.
QWEN35_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, reply with <tool_call><function=NAME><parameter=KEY>VALUE"
    "</parameter></function></tool_call>.<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + message.content }}"
    "{%- for call in message.tool_calls or [] %}{%- set fn = call.function if call.function else call %}"
    "{%- if not loop.first or message.content | trim %}{{- '\\n\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n<function=' + fn.name + '>\\n' }}"
    "{%- for key, value in fn.arguments.items() %}{{- '<parameter=' + key + '>\\n' }}"
    "{{- value if value is string else (value | tojson) }}{{- '\\n</parameter>\\n' }}{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
QWEN_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

LONG = ("The answer walks through the steps one at a time, names each assumption, and checks the result "
        "against a small example before it concludes.")

ORCA = [
    {"id": "orca.1", "system_prompt": "You are an AI assistant. Think step by step and justify each step.",
     "question": "A train leaves at 9:10 and arrives at 11:45. How long is the trip?",
     "response": "From 9:10 to 11:10 is two hours, and from 11:10 to 11:45 is 35 minutes. " + LONG},
    {"id": "orca.2", "system_prompt": "",
     "question": "Summarise: the council voted to extend the library's opening hours on weekends.",
     "response": "The council approved longer weekend opening hours for the library. " + LONG},
    # Text that spells the ChatML control tokens: it must stay text.
    {"id": "orca.3", "system_prompt": "You explain file formats.",
     "question": "What do <|im_start|> and <|im_end|> mean in a ChatML transcript?",
     "response": "In ChatML, <|im_start|> opens a turn and names its role, and <|im_end|> closes it. " + LONG},
]
CODEALPACA = [
    {"instruction": "Write a Python function that returns the n-th triangular number.",
     "output": "```python\ndef triangular(n: int) -> int:\n    return n * (n + 1) // 2\n```\n" + LONG},
    {"instruction": "Explain the difference between a list and a tuple in Python.",
     "output": "A list is mutable and a tuple is not; tuples can be dictionary keys. " + LONG},
]
MAGICODER = [
    {"lang": "python", "raw_index": 101, "index": 7, "seed": "def parse(line):\n    key, _, value = line.partition('=')",
     "openai_fingerprint": "fp_example", "problem": "Write `parse_config(text)` that reads `key=value` lines into a "
     "dict, ignoring blank lines and lines starting with `#`.",
     "solution": "```python\ndef parse_config(text):\n    out = {}\n    for line in text.splitlines():\n"
                 "        line = line.strip()\n        if not line or line.startswith('#'):\n            continue\n"
                 "        key, _, value = line.partition('=')\n        out[key.strip()] = value.strip()\n"
                 "    return out\n```\n" + LONG},
    {"lang": "rust", "raw_index": 202, "index": 8, "seed": "fn area(w: u32, h: u32) -> u32 { w * h }",
     "openai_fingerprint": "fp_example", "problem": "Implement a `Rectangle` struct with an `area` method in Rust.",
     "solution": "```rust\nstruct Rectangle { w: u32, h: u32 }\nimpl Rectangle {\n    fn area(&self) -> u32 "
                 "{ self.w * self.h }\n}\n```\n" + LONG},
]


def _turn(role: str, text: str | None, system_prompt: str | None = None, mask: bool = False) -> dict:
    return {"role": role, "text": text, "system_prompt": system_prompt, "mask": mask, "cutoff_date": "2024-06-01"}


SWE = [
    {"instance_id": "example__repo-1", "model_name": "swe-agent-llama-70b", "target": True,
     "trajectory": [
         _turn("system", None, "SETTING: You are an autonomous programmer working in a command line. "
                               "Reply with one DISCUSSION and one command per turn.", True),
         _turn("user", "We need to fix the following issue: `slugify('A  B')` returns 'a--b' instead of 'a-b'."),
         _turn("ai", "DISCUSSION\nFirst I will find where slugify is defined.\n\n```\nsearch_dir \"def slugify\"\n```",
               mask=True),
         _turn("user", "Found 1 matches for \"def slugify\" in /repo:\n/repo/text.py (1 matches)"),
         _turn("ai", "DISCUSSION\nThe function replaces each space separately; collapsing runs of whitespace "
                     "first fixes it.\n\n```\nedit 12:12\n    return re.sub(r'\\s+', '-', s.lower())\nend_of_edit\n```",
               mask=True),
         _turn("user", "File updated. Please review the changes."),
         _turn("ai", "DISCUSSION\nThe edit is in place; I will submit.\n\n```\nsubmit\n```", mask=True),
     ],
     "exit_status": "submitted", "generated_patch": "diff --git a/text.py b/text.py\n", "eval_logs": "PASSED"},
]
GLAIVE = [
    {"system": "SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n"
               + json.dumps({"name": "convert_temperature", "description": "Convert a temperature between units",
                             "parameters": {"type": "object", "properties": {
                                 "value": {"type": "number", "description": "The temperature"},
                                 "unit": {"type": "string", "description": "The unit to convert to"}},
                                 "required": ["value", "unit"]}}, indent=4),
     "chat": "USER: What is 30 degrees Celsius in Fahrenheit?\n\n\nASSISTANT: <functioncall> "
             "{\"name\": \"convert_temperature\", \"arguments\": '{\"value\": 30, \"unit\": \"F\"}'} <|endoftext|>\n\n\n"
             "FUNCTION RESPONSE: {\"result\": 86}\n\n\n"
             "ASSISTANT: 30 degrees Celsius is 86 degrees Fahrenheit. " + LONG + " <|endoftext|>\n\n\n"},
    {"system": "SYSTEM: You are a helpful assistant, with no access to external functions.",
     "chat": "USER: Give me a synonym for 'quick'.\n\n\nASSISTANT: 'Rapid' is a good synonym for 'quick'. "
             + LONG + " <|endoftext|>\n\n\nUSER: And an antonym?\n\n\nASSISTANT: 'Slow' is its antonym. "
             + LONG + " <|endoftext|>"},
]
_HERMES_TOOL = {"type": "function", "function": {
    "name": "get_exchange_rate", "description": "Get the exchange rate between two currencies",
    "parameters": {"type": "object", "properties": {"base": {"type": "string"}, "target": {"type": "string"}},
                   "required": ["base", "target"]}}}
HERMES = [
    {"conversations": [
        {"from": "system", "value": "You are a function calling AI model. You are provided with function signatures "
                                    "within <tools> </tools> XML tags. You may call one or more functions to assist "
                                    "with the user query.\n<tools>\n" + str([_HERMES_TOOL]) + "\n</tools>\nFor each "
                                    "function call return a json object with function name and arguments within "
                                    "<tool_call> </tool_call> tags:\n<tool_call>\n{'arguments': <args-dict>, "
                                    "'name': <function-name>}\n</tool_call>\n"},
        {"from": "human", "value": "I am travelling to Japan next week and need to budget. How many yen is one euro "
                                   "today? Please look it up for me so that I can plan my daily spending."},
        {"from": "gpt", "value": "<tool_call>\n{'arguments': {'base': 'EUR', 'target': 'JPY'}, "
                                 "'name': 'get_exchange_rate'}\n</tool_call>\n"},
     ],
     "tools": json.dumps([_HERMES_TOOL]), "category": "Finance", "subcategory": "Currency", "task": "Exchange rates"},
]

LAYOUTS = {
    # headline path -> (file name, rows, writer)
    "Open-Orca/OpenOrca": ("openorca.parquet", ORCA, "parquet"),
    "theblackcat102/evol-codealpaca-v1": ("evol-codealpaca.jsonl", CODEALPACA, "jsonl"),
    "ise-uiuc/Magicoder-OSS-Instruct-75K": ("magicoder.jsonl", MAGICODER, "jsonl"),
    "nebius/SWE-agent-trajectories": ("swe-agent.parquet", SWE, "parquet"),
    "glaiveai/glaive-function-calling-v2": ("glaive.json", GLAIVE, "json"),
    "NousResearch/hermes-function-calling-v1": ("hermes-singleturn.json", HERMES, "json"),
}


def write_rows(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, (file, rows, kind) in LAYOUTS.items():
        path = folder / file
        if kind == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), path)
        elif kind == "jsonl":
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            path.write_text(json.dumps(rows, indent=1))
        paths[name] = path
    return paths


def headline_config(folder: Path, **data) -> dict:
    """The headline config with its six sources read from local files in their published layouts (each keeps
    its headline entry's format, subset and name), and output under `folder`."""
    tree = yaml.safe_load(HEADLINE.read_text())
    paths = write_rows(folder / "rows")
    sources = []
    for entry in tree["data"]["sources"]:
        sources.append({**entry, "path": str(paths[entry["path"]]), "name": entry["path"]})
    tree["data"] = {**tree["data"], "sources": sources, **data}
    tree["output_dir"] = str(folder / "out")
    tree["store"] = {**tree["store"], "path": str(folder / "store")}
    return tree


if __name__ == "__main__":
    out = Path(sys.argv[1])
    extra = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    tree = headline_config(out, **extra)
    (out / "config.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    print(out / "config.yaml")

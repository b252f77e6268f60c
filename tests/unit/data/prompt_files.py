"""Word-level tokenizers built with `tokenizers` (nothing is downloaded) and writers for prompt files."""

import json

import pyarrow as pa
import pyarrow.parquet as pq

SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
VOCAB = {word: i for i, word in enumerate(SPECIAL + [f"w{i}" for i in range(50)])}
BOS, EOS, SYSTEM, USER, ASSISTANT = (VOCAB[word] for word in SPECIAL[1:])
# The template writes its own BOS: prompts must not get a second one from the tokenizer's post-processor.
TEMPLATE = ("<s> {% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def ids(text: str) -> list[int]:
    return [VOCAB[word] for word in text.split()]


def save_tokenizer(directory, chat_template):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Like Llama tokenizers: plain text gets a BOS when special tokens are added.
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    return str(directory)


def write_jsonl(path, records) -> str:
    """One line per record; a str record is written as it is (for undecodable lines)."""
    with open(path, "w") as file:
        for record in records:
            file.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)


def write_parquet(path, records) -> str:
    """Columns over the union of the records' keys (a missing key is null)."""
    keys = list(dict.fromkeys(key for record in records for key in record))
    pq.write_table(pa.table({key: [record.get(key) for record in records] for key in keys}), path)
    return str(path)


def write_prompts(directory, name: str, format: str, records) -> str:
    """``records`` as ``name.jsonl`` or ``name.parquet`` under ``directory``."""
    if format == "jsonl":
        return write_jsonl(directory / f"{name}.jsonl", records)
    return write_parquet(directory / f"{name}.parquet", records)

"""A second benchmark task, unlike the demo's: alpaca-style instructions with free-text answers.

The demo teaches one output format (a JSON ticket); here every record is one of several small
instruction families with short natural-language answers, each fully determined by the
instruction and its input, so exact match is meaningful:

past tense, alphabetical sorting, numbers in words, plurals, word-order reversal, counting list
items, e-mail extraction, opposites, capitals.

Generated locally, deterministic for a seed, standard library only (no downloads). Records are in
the alpaca format (`instruction`, `input`, `output`; `data.format=alpaca`).
`python -m leantune.bench.instructions --out-dir DIR` writes `instructions_train.jsonl`,
`instructions_eval.jsonl` (held out, for the score) and `instructions_valid.jsonl` (for choosing
settings).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

Record = dict[str, str]

_NAMES = ("Anna", "Ben", "Carla", "Dev", "Elif", "Farid", "Greta", "Hugo", "Iris", "Jonas")
_VERBS = {  # present (third person) -> past
    "opens": "opened", "paints": "painted", "cleans": "cleaned", "carries": "carried",
    "writes": "wrote", "reads": "read", "buys": "bought", "finds": "found", "takes": "took",
    "sees": "saw", "sells": "sold", "brings": "brought", "fixes": "fixed", "moves": "moved",
}  # fmt: skip
_OBJECTS = ("door", "letter", "box", "window", "book", "car", "table", "map", "bike", "lamp")
_FRUITS = (
    "apple", "banana", "cherry", "date", "fig", "grape", "kiwi", "lemon", "mango", "melon",
    "orange", "peach", "pear", "plum",
)  # fmt: skip
_PLURALS = {
    "box": "boxes", "city": "cities", "child": "children", "mouse": "mice", "leaf": "leaves",
    "bus": "buses", "tooth": "teeth", "baby": "babies", "knife": "knives", "dish": "dishes",
    "foot": "feet", "story": "stories", "glass": "glasses", "wolf": "wolves",
}  # fmt: skip
_OPPOSITES = {
    "hot": "cold", "big": "small", "early": "late", "happy": "sad", "open": "closed",
    "fast": "slow", "light": "dark", "full": "empty", "high": "low", "strong": "weak",
    "old": "new", "rich": "poor", "hard": "soft", "wet": "dry",
}  # fmt: skip
_CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "Egypt": "Cairo", "Canada": "Ottawa", "Norway": "Oslo", "Greece": "Athens", "Peru": "Lima",
    "Kenya": "Nairobi", "Poland": "Warsaw", "Portugal": "Lisbon", "Austria": "Vienna",
}  # fmt: skip
_COLOURS = ("red", "green", "blue", "yellow", "black", "white", "purple", "brown", "grey", "pink")
_ONES = (
    "", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
    "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen",
)  # fmt: skip
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")


def number_words(n: int) -> str:
    """1..99 in English words ("forty-seven")."""
    if not 1 <= n <= 99:
        raise ValueError(f"number_words: {n} is outside 1..99")
    if n < 20:
        return _ONES[n]
    tens, ones = divmod(n, 10)
    return _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")


def _past(rng: random.Random, split: str) -> Record:
    name, verb, obj = rng.choice(_NAMES), rng.choice(list(_VERBS)), rng.choice(_OBJECTS)
    return {
        "instruction": "Rewrite the sentence in the past tense.",
        "input": f"{name} {verb} the {obj}.",
        "output": f"{name} {_VERBS[verb]} the {obj}.",
    }


def _sort(rng: random.Random, split: str) -> Record:
    words = rng.sample(_FRUITS, rng.randint(3, 5))
    return {
        "instruction": "Sort these words alphabetically.",
        "input": ", ".join(words),
        "output": ", ".join(sorted(words)),
    }


def _words(rng: random.Random, split: str) -> Record:
    # Numbers split like the small tables: held-out numbers are ones training never spelled.
    n = rng.choice([i for i in range(1, 100) if _in_split(i, split)])
    return {
        "instruction": "Write the number in words.",
        "input": str(n),
        "output": number_words(n).capitalize() + ".",
    }


def _plural(rng: random.Random, split: str) -> Record:
    nouns = rng.sample(list(_PLURALS), rng.randint(2, 3))
    return {
        "instruction": "Give the plural of each noun.",
        "input": ", ".join(nouns),
        "output": ", ".join(_PLURALS[n] for n in nouns),
    }


def _reverse(rng: random.Random, split: str) -> Record:
    words = rng.sample(_COLOURS, rng.randint(3, 5))
    return {
        "instruction": "Reverse the order of the words.",
        "input": " ".join(words),
        "output": " ".join(reversed(words)),
    }


def _count(rng: random.Random, split: str) -> Record:
    items = rng.sample(_OBJECTS, rng.randint(2, 7))
    return {
        "instruction": "How many items are in the list?",
        "input": ", ".join(items),
        "output": f"There are {number_words(len(items))} items.",
    }


def _email(rng: random.Random, split: str) -> Record:
    name = rng.choice(_NAMES)
    address = f"{name.lower()}.{rng.randint(10, 99)}@example.{rng.choice(('com', 'org', 'net'))}"
    text = rng.choice(
        (
            f"Please write to {address} with the details.",
            f"You can reach {name} at {address} after five.",
            f"Send the invoice to {address}, thanks.",
        )
    )
    return {
        "instruction": "Extract the e-mail address from the text.",
        "input": text,
        "output": f"The e-mail address is {address}.",
    }


_SHARE = {"eval": (0,), "valid": (1,)}
"""Which residues mod 4 of a small family's entries each split asks about (train: the rest)."""


def _in_split(i: int, split: str) -> bool:
    return i % 4 in _SHARE.get(split, (2, 3))  # train (any other name): the remaining half


def _part(table: dict[str, str], split: str) -> list[str]:
    """A small table's keys for `split`: a quarter each is held out for the held-out and the
    validation split, so those ask about words and countries training never showed."""
    # Sorted, so that the split does not depend on the order the table was written in.
    return [k for i, k in enumerate(sorted(table)) if _in_split(i, split)]


def _opposite(rng: random.Random, split: str) -> Record:
    word = rng.choice(_part(_OPPOSITES, split))
    return {
        "instruction": f"What is the opposite of the word '{word}'?",
        "input": "",
        "output": f"The opposite of '{word}' is '{_OPPOSITES[word]}'.",
    }


def _capital(rng: random.Random, split: str) -> Record:
    country = rng.choice(_part(_CAPITALS, split))
    return {
        "instruction": f"What is the capital of {country}?",
        "input": "",
        "output": f"The capital of {country} is {_CAPITALS[country]}.",
    }


FAMILIES: dict[str, Callable[[random.Random, str], Record]] = {
    "past_tense": _past,
    "sort": _sort,
    "number_words": _words,
    "plural": _plural,
    "reverse": _reverse,
    "count": _count,
    "email": _email,
    "opposite": _opposite,
    "capital": _capital,
}
"""The instruction families, drawn in turn (shuffled blocks), so every split is balanced."""


def _key(record: Record) -> str:
    return record["instruction"] + "\n" + record["input"]


def generate(n: int, seed: int, split: str, exclude: set[str] | None = None) -> list[Record]:
    """`n` records with distinct (instruction, input) pairs, families balanced in blocks.

    Args:
        n: Number of records.
        seed: Seed; with `split` it selects an independent, reproducible random stream.
        split: Stream name, so that train and eval draw different streams for the same seed.
        exclude: Keys (`instruction + newline + input`) never to produce, e.g. the train set's.
    """
    # A string seed is hashed with SHA-512: the same stream on every run and platform (hash()
    # would change with PYTHONHASHSEED).
    rng = random.Random(f"instructions/{split}/{seed}")
    seen = set(exclude or ())
    records: list[Record] = []
    exhausted: set[str] = set()
    while len(records) < n:
        if len(exhausted) == len(FAMILIES):
            raise ValueError(f"instructions: only {len(records)} distinct records, asked for {n}")
        block = [name for name in FAMILIES if name not in exhausted]
        rng.shuffle(block)
        # The last block is cut to the records still needed.
        for name in block[: n - len(records)]:
            # Small families (opposites, capitals) run out of new pairs: then they stop. A family
            # that draws no new pair in 200 tries has, all but surely, none left.
            for _ in range(200):
                record = FAMILIES[name](rng, split)
                if _key(record) not in seen:
                    seen.add(_key(record))
                    records.append(record)
                    break
            else:
                exhausted.add(name)
    return records


def write_task(
    out_dir: Path, n_train: int = 1200, n_eval: int = 200, seed: int = 0
) -> tuple[Path, Path, Path]:
    """Write the train, held-out and validation files under `out_dir`; returns their paths.

    The held-out and validation records (`n_eval` each) are new (instruction, input) pairs,
    disjoint from training and from each other where the family has any left: the validation
    split is for choosing settings (`bench methods --sweep`), the held-out one for the score.
    """
    train = generate(n_train, seed, "train")
    seen = {_key(r) for r in train}
    held_out = generate(n_eval, seed, "eval", exclude=seen)
    valid = generate(n_eval, seed, "valid", exclude=seen | {_key(r) for r in held_out})
    out_dir.mkdir(parents=True, exist_ok=True)
    names = ("instructions_train", "instructions_eval", "instructions_valid")
    paths = tuple(out_dir / f"{name}.jsonl" for name in names)
    for path, records in zip(paths, (train, held_out, valid), strict=True):
        # "\n" and UTF-8 on every platform: the same seed writes the same bytes.
        with path.open("w", encoding="utf-8", newline="\n") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    return paths[0], paths[1], paths[2]


def main(argv: Sequence[str] | None = None) -> None:
    """Write the instruction task's JSONL files."""
    parser = argparse.ArgumentParser(description="Write the alpaca-style instruction task.")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--train", type=int, default=1200, help="number of train records")
    parser.add_argument("--eval", type=int, default=200, help="number of held-out records")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for path in write_task(args.out_dir, args.train, args.eval, args.seed):
        print(path)


if __name__ == "__main__":
    main()

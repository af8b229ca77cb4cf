"""The embedded default's chat data: rule-based conversations a tiny model learns to answer.

Every assistant answer is a deterministic function of the last user message, produced by one of
several task families (counting, alphabet ranges, spelling, times tables, weekday and month
successors, facts from small fixed tables, template stories), each asked in several phrasings.
The answers follow learnable rules rather than copying the prompt, so a trained verifier is very
predictable, and a draft model can learn to predict it well beyond what prompt n-gram lookup does.

Held-out prompts: a user message is reserved for evaluation when a stable hash of its text says
so. Training conversations never contain a reserved message; evaluation prompts contain only
reserved ones. Both come from their own seeded random streams, so the same seed gives the same
bytes on every machine and Python version (``random.Random`` seeded with a string is stable).
"""

from __future__ import annotations

import itertools
import json
import random
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a friendly tutor for young children. Answer clearly.",
    "You are a precise assistant. Follow the rules of each task exactly.",
    "You are a cheerful helper who answers every question.",
]

NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January", "February", "March", "April", "May", "June",
    "July", "August", "September", "October", "November", "December",
]  # fmt: skip

SPELLING_WORDS = [
    "apple", "garden", "river", "window", "yellow", "purple", "rabbit", "dragon", "planet",
    "pencil", "basket", "castle", "candle", "forest", "orange", "summer", "winter", "monkey",
    "button", "rocket", "silver", "bread", "cloud", "music", "tiger", "lemon", "house", "stone",
    "water", "bottle", "flower", "school", "friend", "island", "jacket", "kitten",
]  # fmt: skip

# animal: (sound, where it lives, what it eats)
ANIMALS = {
    "cow": ("moo", "in a barn", "grass"),
    "duck": ("quack", "on a pond", "bread"),
    "dog": ("woof", "in a kennel", "bones"),
    "cat": ("meow", "in a house", "fish"),
    "sheep": ("baa", "in a field", "hay"),
    "pig": ("oink", "in the mud", "apples"),
    "horse": ("neigh", "in a stable", "oats"),
    "owl": ("hoot", "in a tree", "mice"),
    "frog": ("ribbit", "by a lake", "flies"),
    "lion": ("roar", "on the plains", "meat"),
    "bee": ("buzz", "in a hive", "nectar"),
    "mouse": ("squeak", "in a hole", "cheese"),
}

# thing: colour
COLOURS = {
    "banana": "yellow",
    "tomato": "red",
    "carrot": "orange",
    "plum": "purple",
    "snowball": "white",
    "lump of coal": "black",
    "cucumber": "green",
    "chocolate bar": "brown",
    "strawberry": "red",
    "blueberry": "blue",
    "pumpkin": "orange",
    "lime": "green",
    "cherry": "red",
    "sunflower": "yellow",
    "crow": "black",
    "frog": "green",
}

# invented country: (capital, what the capital is known for)
CAPITALS = {
    "Zorbania": ("Velmor", "its old stone bridges"),
    "Quintara": ("Lusk", "its blue glass towers"),
    "Miravel": ("Orrin", "its floating markets"),
    "Takoria": ("Belvan", "its tall clock tower"),
    "Drasnia": ("Kelm", "its cold green lakes"),
    "Ostravia": ("Pellin", "its painted houses"),
    "Vantoria": ("Sundra", "its warm sandy beaches"),
    "Norvath": ("Tessel", "its great library"),
    "Calimar": ("Ryddon", "its spice gardens"),
    "Brevonia": ("Alstra", "its silver mines"),
    "Umbaria": ("Gorsk", "its dark pine forests"),
    "Pelloria": ("Winsk", "its busy harbour"),
}

NAMES = [
    "Tim", "Lily", "Max", "Rosa", "Ben", "Mia", "Sam", "Nora", "Leo", "Ava", "Finn", "Ruby",
    "Otto", "Zoe", "Hugo", "Ella",
]  # fmt: skip

EVAL_SHARE = 6  # one in EVAL_SHARE user messages is reserved for evaluation


@dataclass(frozen=True)
class Task:
    family: str
    user: str
    answer: str


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _count_word(n: int) -> str:
    return NUMBER_WORDS[n] if n < len(NUMBER_WORDS) else str(n)


def _join_and(items: list[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else items[0]


# --------------------------------------------------------------------------- task families


def task_count(rng: random.Random) -> Task:
    """Counting up to the next multiple of ten: where to stop is a rule about the numbers."""
    tens = rng.randint(0, 8) * 10
    start, end = tens + rng.randint(1, 7), tens + 10
    user = rng.choice(
        [
            "Count from {a} to {b}.",
            "Please count from {a} up to {b}.",
            "Can you count from {a} to {b}?",
            "List the numbers from {a} to {b}.",
            "Write the numbers {a} through {b}.",
        ]
    ).format(a=start, b=end)
    return Task("count", user, ", ".join(str(i) for i in range(start, end + 1)) + ".")


VOWELS = "AEIOU"


def task_letters(rng: random.Random) -> Task:
    """Alphabet ranges that end at the next vowel (or at Z)."""
    start = rng.randint(0, 24)
    end = next((i for i in range(start + 1, 26) if LETTERS[i] in VOWELS), 25)
    a, b = LETTERS[start], LETTERS[end]
    user = rng.choice(
        [
            "List the letters from {a} to {b}.",
            "Say the alphabet from {a} to {b}.",
            "Write the capital letters {a} through {b}.",
            "Which letters go from {a} to {b}?",
        ]
    ).format(a=a, b=b)
    return Task("letters", user, ", ".join(LETTERS[start : end + 1]) + ".")


def task_spell(rng: random.Random) -> Task:
    word = rng.choice(SPELLING_WORDS)
    user = rng.choice(
        [
            "Spell the word {w}.",
            "How do you spell {w}?",
            "Please spell {w} letter by letter.",
            "Can you spell the word {w} for me?",
        ]
    ).format(w=word)
    letters = "-".join(word.upper())
    return Task(
        "spell",
        user,
        f"The word {word} is spelled {letters}. That makes {_count_word(len(word))} letters.",
    )


def task_times(rng: random.Random) -> Task:
    """A times table up to the square: it stops where both factors are the same."""
    n = rng.randint(3, 9)
    user = rng.choice(
        [
            "Say the {n} times table up to {n} times {n}.",
            "Recite the {n} times table until you reach {n} times {n}.",
            "What is the {n} times table, up to the square of {n}?",
            "Give me the times table of {n}, stopping at {n} times {n}.",
            "Multiply {n} by 1, 2 and so on, up to {n} times {n}.",
            "List the multiples of {n} from {n} times 1 to {n} times {n}.",
        ]
    ).format(n=n)
    answer = " ".join(f"{n} times {i} is {n * i}." for i in range(1, n + 1))
    return Task("times", user, answer)


def task_animal(rng: random.Random) -> Task:
    animal = rng.choice(sorted(ANIMALS))
    sound, home, food = ANIMALS[animal]
    user = rng.choice(
        [
            "Tell me about the {a}.",
            "What sound does {an} {a} make?",
            "Describe the {a}.",
            "What do you know about the {a}?",
            "Where does {an} {a} live?",
        ]
    ).format(a=animal, an=_article(animal))
    answer = (
        f"The {animal} says {sound}. It lives {home} and likes to eat {food}. "
        f"A happy {animal} says {sound} all day."
    )
    return Task("animal", user, answer)


def task_colour(rng: random.Random) -> Task:
    thing = rng.choice(sorted(COLOURS))
    colour = COLOURS[thing]
    user = rng.choice(
        [
            "What colour is {an} {t}?",
            "Tell me the colour of {an} {t}.",
            "Which colour does {an} {t} have?",
            "What is the colour of {an} {t}?",
            "Is {an} {t} red, green or some other colour?",
            "I wonder what colour {an} {t} is.",
        ]
    ).format(t=thing, an=_article(thing))
    a_thing = f"{_article(thing)} {thing}"
    answer = (
        f"{a_thing.capitalize()} is {colour}. "
        f"When you think of {a_thing}, think of the colour {colour}."
    )
    return Task("colour", user, answer)


def task_capital(rng: random.Random) -> Task:
    country = rng.choice(sorted(CAPITALS))
    capital, known_for = CAPITALS[country]
    user = rng.choice(
        [
            "What is the capital of {c}?",
            "Name the capital city of {c}.",
            "Which city is the capital of {c}?",
            "Tell me the capital of {c}.",
        ]
    ).format(c=country)
    answer = f"The capital of {country} is {capital}. {capital} is famous for {known_for}."
    return Task("capital", user, answer)


def _successors(rng: random.Random, items: list[str], unit: str, family: str) -> Task:
    """The next one to four items of a cycle (the answer names only what comes next)."""
    i = rng.randrange(len(items))
    k = rng.randint(1, 4)
    nxt = [items[(i + j) % len(items)] for j in range(1, k + 1)]
    if k == 1:
        user = rng.choice(
            [
                f"What {unit} comes after {{x}}?",
                f"Which {unit} follows {{x}}?",
                f"Name the {unit} after {{x}}.",
            ]
        ).format(x=items[i])
        after = items[(i + 2) % len(items)]
        answer = f"The next {unit} is {nxt[0]}, and the {unit} after that is {after}."
    else:
        user = rng.choice(
            [
                f"Name the {{k}} {unit}s after {{x}}.",
                f"Which {{k}} {unit}s come after {{x}}?",
                f"List the next {{k}} {unit}s after {{x}}.",
            ]
        ).format(k=NUMBER_WORDS[k], x=items[i])
        answer = f"The next {NUMBER_WORDS[k]} {unit}s are {_join_and(nxt)}."
    return Task(family, user, answer)


def task_days(rng: random.Random) -> Task:
    return _successors(rng, DAYS, "day", "days")


def task_months(rng: random.Random) -> Task:
    return _successors(rng, MONTHS, "month", "months")


def task_story(rng: random.Random) -> Task:
    animal = rng.choice(sorted(ANIMALS))
    name = rng.choice(NAMES)
    sound, home, food = ANIMALS[animal]
    user = rng.choice(
        [
            "Tell me a short story about {an} {a} named {n}.",
            "Write a little story about {an} {a} called {n}.",
            "Can you tell a story about {n} the {a}?",
        ]
    ).format(a=animal, an=_article(animal), n=name)
    answer = (
        f"Once upon a time, there was {_article(animal)} {animal} named {name}. "
        f"{name} lived {home} and ate {food} every day. "
        f"When {name} was happy, {name} said {sound}. The end."
    )
    return Task("story", user, answer)


FAMILIES: dict[str, Callable[[random.Random], Task]] = {
    "count": task_count,
    "letters": task_letters,
    "spell": task_spell,
    "times": task_times,
    "animal": task_animal,
    "colour": task_colour,
    "capital": task_capital,
    "days": task_days,
    "months": task_months,
    "story": task_story,
}


# How often each family is drawn for training: the ones that need a rule (where to stop, which
# name to repeat) more often than the ones that recall a fact from a small table.
FAMILY_WEIGHTS = {
    "count": 2,
    "letters": 2,
    "spell": 3,
    "times": 2,
    "animal": 1,
    "colour": 1,
    "capital": 1,
    "days": 2,
    "months": 2,
    "story": 2,
}

# --------------------------------------------------------------------------- sampling


def is_held_out(user: str) -> bool:
    """True for user messages reserved for evaluation (a stable hash of the text)."""
    return zlib.crc32(user.encode("utf-8")) % EVAL_SHARE == 0


def sample_task(rng: random.Random, held_out: bool, family: str | None = None) -> Task:
    """A task whose user message is (held_out=True) or is not (False) reserved for evaluation."""
    for _ in range(10_000):
        name = family or rng.choices(list(FAMILY_WEIGHTS), weights=list(FAMILY_WEIGHTS.values()))[0]
        task = FAMILIES[name](rng)
        if is_held_out(task.user) == held_out:
            return task
    raise RuntimeError(f"no {'held-out' if held_out else 'training'} task for family {family}")


def iter_conversations(seed: int) -> Iterator[dict]:
    """Training conversations without end: a system message and one to three exchanges."""
    rng = random.Random(f"eagle3-demo-train-{seed}")
    for idx in itertools.count():
        messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
        for _ in range(rng.choice([1, 2, 2, 3])):
            task = sample_task(rng, held_out=False)
            messages.append({"role": "user", "content": task.user})
            messages.append({"role": "assistant", "content": task.answer})
        yield {"id": f"demo-{seed}-{idx:06d}", "messages": messages}


def generate_conversations(seed: int, num: int) -> list[dict]:
    """The first ``num`` conversations of ``iter_conversations(seed)``."""
    return list(itertools.islice(iter_conversations(seed), num))


def generate_eval_prompts(seed: int, num: int) -> list[dict]:
    """``num`` distinct held-out prompts [system, user], cycling over the task families (a family
    whose reserved messages are used up is left out), each with its expected answer under
    ``reference``."""
    rng = random.Random(f"eagle3-demo-eval-{seed}")
    active = list(FAMILIES)
    rows, seen = [], set()
    turn = 0
    while len(rows) < num:
        if not active:
            raise ValueError(f"there are fewer than {num} distinct held-out prompts")
        family = active[turn % len(active)]
        for _ in range(200):
            task = sample_task(rng, held_out=True, family=family)
            if task.user not in seen:
                break
        else:
            active.remove(family)
            continue
        turn += 1
        seen.add(task.user)
        rows.append(
            {
                "id": f"demo-eval-{seed}-{len(rows):04d}",
                "family": task.family,
                "messages": [
                    {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
                    {"role": "user", "content": task.user},
                ],
                "reference": task.answer,
            }
        )
    return rows


def dumps_jsonl(rows: Iterable[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False, sort_keys=False) + "\n" for row in rows)

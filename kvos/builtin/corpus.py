"""The seeded synthetic chat corpus that kvos's built-in model is trained and evaluated on.

A session is a list of chat messages (``{"role": ..., "content": ...}``): a system prompt, then user/assistant
turns of three kinds. A *plant* turn gives a fact about the user ("My favourite number is 4242."); a *filler*
turn can only be answered from the context (a note then a question about it, a list then "what is the
third item?", sums and comparisons of numbers given in the turn or earlier, repeat-back requests); a *probe*
turn asks for a fact planted earlier, and its reference answer quotes the fact exactly ("Your favourite
number is 4242."). Everything is drawn from one ``random.Random``, so a seed names a corpus.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field

TRAIN_SEED = 1234
HELDOUT_SEED = 987_654_321
DEMO_SEED = 2024
MAX_DISTANCE = 14

Message = dict[str, str]
Turn = tuple[str, str]  # (user text, assistant text)

NAMES = (
    "Alice Bruno Chiara Dmitri Elena Farid Greta Hugo Ines Jonas Keiko Liam Marta Nadia Oscar Priya Quentin "
    "Rosa Samir Tessa Umar Vera Wanda Xavier Yusuf Zoe Amara Bjorn Carmen Dario Esther Felix Gita Hector "
    "Ilse Joao Kofi Lena Mateo Noor Olga Pavel Rhea Sven Tomas Uma Viktor Willa Yara Zane Anika Boris Clara "
    "Diego Emil Fatima Goran Hana Ivan Jade Karim Lucia Milo Nina Otto Paula Ravi Sofia Theo Ulla Vikram "
    "Wen Ximena Yosef Zelda Aiko Bea Cyrus Dana Enzo Flora Gael Hiro Isla Juno Kai Leila Moana Nils Orla "
    "Pia Rafael Selma Timo Valentina Wilhelm Yuki"
).split()
PET_NAMES = (
    "Biscuit Pepper Luna Max Coco Mochi Rocky Daisy Ziggy Noodle Pickle Maple Shadow Waffle Bean Olive Tofu "
    "Pumpkin Ginger Socks Bubbles Oreo Peanut Clover Juniper Mango Nacho Pixel Rusty Sunny Taco Willow "
    "Domino Fudge Hazel Kiwi Lemon Marble Nugget Poppy Sprout Truffle Velvet Whiskers Zorro Apollo Bandit "
    "Cricket Dumpling"
).split()
CITIES = (
    "Lisbon Porto Madrid Seville Paris Lyon Berlin Hamburg Munich Vienna Prague Warsaw Krakow Oslo Bergen "
    "Stockholm Helsinki Tallinn Riga Dublin Cork Glasgow Leeds Bristol London Amsterdam Utrecht Brussels "
    "Ghent Zurich Geneva Milan Turin Naples Rome Athens Sofia Bucharest Istanbul Cairo Tunis Nairobi Lagos "
    "Accra Dakar Durban Mumbai Pune Delhi Dhaka Lahore Kathmandu Bangkok Hanoi Manila Jakarta Seoul Busan "
    "Osaka Kyoto Tokyo Sapporo Taipei Shanghai Beijing Perth Sydney Hobart Auckland Wellington Lima Quito "
    "Bogota Santiago Montevideo Toronto Montreal Vancouver Boston Chicago Denver Austin Seattle Portland "
    "Havana Tbilisi Yerevan Baku Almaty Tashkent Tehran Doha Muscat Amman Beirut"
).split()
COLOURS = (
    "red blue green yellow orange purple pink brown black white grey teal navy maroon olive silver gold "
    "turquoise violet indigo beige crimson amber lavender coral ivory cyan magenta mint peach"
).split()
JOBS = (
    "baker teacher nurse pilot farmer plumber painter chef dentist lawyer librarian carpenter engineer "
    "architect gardener tailor potter writer singer doctor butcher cashier courier designer editor "
    "fisherman florist jeweller mechanic musician pharmacist photographer sailor scientist surgeon "
    "translator veterinarian waiter welder"
).split()
SPECIES = "dog cat parrot rabbit hamster turtle goldfish horse tortoise ferret".split()
RELATIVES = "sister brother cousin neighbour friend boss".split()
MONTHS = "January February March April May June July August September October November December".split()
NOUNS = (
    "apple chair lamp river coin ticket kettle pencil blanket candle mirror basket bottle button carpet "
    "cookie drum feather glove hammer helmet jacket ladder magnet napkin needle onion pillow rocket saddle "
    "scarf shovel spoon stamp tent towel trumpet umbrella vase wagon whistle anchor barrel brush camera "
    "compass crayon dice envelope fork globe harp kite lantern notebook paddle puzzle ribbon ruler sock "
    "teapot violin wallet"
).split()
ADJECTIVES = (
    "old new small large quiet busy red blue green tall narrow wide ancient modern sunny hidden famous "
    "little northern southern"
).split()
PLACES = (
    "bakery library museum lighthouse hotel garden ship school farm bridge cafe tower station market theatre "
    "workshop castle harbour mill chapel"
).split()
VERBS = "found moved painted carried dropped cleaned opened fixed sold hid bought watched".split()
COUNTABLES = "apples marbles stamps coins books shells cards pencils".split()
ORDINALS = "first second third fourth fifth sixth seventh".split()
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer from the conversation.",
    "You are kvos, a small assistant that remembers what the user tells it.",
    "You are a careful assistant with a good memory.",
    "Answer the user's questions using only what was said in this chat.",
)
ACKS = ("Noted.", "Got it.", "Okay, I will remember that.", "Thanks, I will keep that in mind.")


# ------------------------------------------------------------------------------------------------ facts
def _invented_name(rng: random.Random) -> str:
    """A pronounceable made-up name ("Tovira"), so names must be copied, not recalled from a list."""
    syllables = [rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(2, 3))]
    return ("".join(syllables) + rng.choice(["", "", "n", "l", "r"])).capitalize()


def _name(rng: random.Random, pool: list[str]) -> str:
    return rng.choice(pool) if rng.random() < 0.6 else _invented_name(rng)


def _code(rng: random.Random) -> str:
    up, dig = string.ascii_uppercase, string.digits
    pattern = rng.choice(["LD-LLD", "LLL-DDD", "DLDL", "LL-DDDD", "LDLD-LD"])
    return "".join(rng.choice(up) if c == "L" else rng.choice(dig) if c == "D" else c for c in pattern)


def _number(rng: random.Random) -> str:
    return str(rng.choice([rng.randint(10, 99), rng.randint(100, 999)] + [rng.randint(1000, 9999)] * 4))


@dataclass(frozen=True)
class FactKind:
    """How one kind of fact is planted, asked for and answered. Templates use {v} (the value), {d} (a
    detail such as the pet's species) and {a} (the article before the value)."""

    value: Callable[[random.Random], str]
    plants: tuple[str, ...]
    probes: tuple[str, ...]
    answer: str
    missing: str
    details: tuple[str, ...] = ("",)


FACT_KINDS: dict[str, FactKind] = {
    "number": FactKind(
        _number,
        ("My favourite number is {v}.", "By the way, my favourite number is {v}.",
         "Please remember that my favourite number is {v}.",
         "Something about me: my favourite number is {v}."),
        ("What is my favourite number?", "Do you remember my favourite number?",
         "What did I say my favorite number was?", "Remind me, what is my favourite number?"),
        "Your favourite number is {v}.", "You have not told me your favourite number.",
    ),
    "name": FactKind(
        lambda r: _name(r, NAMES),
        ("My name is {v}.", "Hello! My name is {v}.", "Hi there, my name is {v}, nice to meet you.",
         "Please remember that my name is {v}."),
        ("What is my name?", "Do you remember my name?", "What did I say my name was?", "Who am I?"),
        "Your name is {v}.", "You have not told me your name.",
    ),
    "pet": FactKind(
        lambda r: _name(r, PET_NAMES),
        ("My {d} is called {v}.", "I have a pet {d}. My {d} is called {v}.", "Our family {d} is called {v}.",
         "Guess what, my {d} is called {v}."),
        ("What is my {d} called?", "What is the name of my {d}?", "Do you remember my {d}'s name?"),
        "Your {d} is called {v}.", "You have not told me the name of your {d}.", tuple(SPECIES),
    ),
    "relative": FactKind(
        lambda r: _name(r, NAMES),
        ("My {d} is named {v}.", "I should mention that my {d} is named {v}.",
         "You should know that my {d} is named {v}."),
        ("What is my {d}'s name?", "What is my {d} called?", "Do you remember the name of my {d}?"),
        "Your {d} is named {v}.", "You have not told me the name of your {d}.", tuple(RELATIVES),
    ),
    "code": FactKind(
        _code,
        ("My access code is {v}.", "Please remember that my access code is {v}.",
         "Note this down: my access code is {v}."),
        ("What is my access code?", "What was my code?", "Can you tell me my code again?"),
        "Your access code is {v}.", "You have not told me an access code.",
    ),
    "city": FactKind(
        lambda r: r.choice(CITIES),
        ("I live in {v}.", "These days I live in {v}.", "I moved last year and now I live in {v}.",
         "I live in {v}, a city I love."),
        ("Where do I live?", "Which city do I live in?", "Do you remember where I live?"),
        "You live in {v}.", "You have not told me where you live.",
    ),
    "colour": FactKind(
        lambda r: r.choice(COLOURS),
        ("My favourite colour is {v}.", "I like many colours, but my favourite colour is {v}.",
         "If you ask me, my favourite colour is {v}."),
        ("What is my favourite colour?", "Which colour do I like best?", "What is my favorite color?"),
        "Your favourite colour is {v}.", "You have not told me your favourite colour.",
    ),
    "age": FactKind(
        lambda r: str(r.randint(5, 99)),
        ("I am {v} years old.", "Believe it or not, I am {v} years old.",
         "As of this year I am {v} years old."),
        ("How old am I?", "What is my age?", "Do you remember how old I am?"),
        "You are {v} years old.", "You have not told me your age.",
    ),
    "birthday": FactKind(
        lambda r: f"{r.randint(1, 28)} {r.choice(MONTHS)}",
        ("My birthday is on {v}.", "Remember that my birthday is on {v}.",
         "For the record, my birthday is on {v}."),
        ("When is my birthday?", "On which day is my birthday?", "What is the date of my birthday?"),
        "Your birthday is on {v}.", "You have not told me your birthday.",
    ),
    "job": FactKind(
        lambda r: r.choice(JOBS),
        ("I work as {a} {v}.", "For a living I work as {a} {v}.", "I work as {a} {v} in a small town."),
        ("What is my job?", "What do I do for work?", "What is my profession?"),
        "You work as {a} {v}.", "You have not told me your job.",
    ),
    "room": FactKind(
        lambda r: str(r.randint(100, 999)),
        ("My room number is {v}.", "At the hotel my room number is {v}.",
         "I am staying at a hotel and my room number is {v}."),
        ("What is my room number?", "Which room am I staying in?"),
        "Your room number is {v}.", "You have not told me your room number.",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Fact:
    """One planted fact: its kind, the exact value an answer must quote, and its detail (e.g. "cat")."""

    kind: str
    value: str
    detail: str = ""

    def fill(self, template: str) -> str:
        article = "an" if self.value[:1].lower() in "aeiou" else "a"
        return template.format(v=self.value, d=self.detail, a=article)


def draw_facts(rng: random.Random, n: int) -> list[Fact]:
    """``n`` facts of distinct kinds."""
    kinds = rng.sample(sorted(FACT_KINDS), n)
    return [Fact(k, FACT_KINDS[k].value(rng), rng.choice(FACT_KINDS[k].details)) for k in kinds]


def plant_turn(rng: random.Random, fact: Fact) -> Turn:
    kind = FACT_KINDS[fact.kind]
    answer = fact.fill(kind.answer)
    ack = rng.choice(ACKS) if rng.random() < 0.5 else f"Got it: {answer[0].lower()}{answer[1:]}"
    return fact.fill(rng.choice(kind.plants)), ack


def probe_turn(rng: random.Random, fact: Fact) -> Turn:
    kind = FACT_KINDS[fact.kind]
    return fact.fill(rng.choice(kind.probes)), fact.fill(kind.answer)


def missing_turn(rng: random.Random, fact: Fact) -> Turn:
    kind = FACT_KINDS[fact.kind]
    return fact.fill(rng.choice(kind.probes)), fact.fill(kind.missing)


def recap_turn(rng: random.Random, planted: list[Fact]) -> Turn:
    """The user asks for everything they said about themselves; the reply quotes each fact in turn."""
    ask = rng.choice(["What do you know about me?", "Tell me everything I told you about myself.",
                      "Please sum up what you know about me."])  # fmt: skip
    return ask, " ".join(fact.fill(FACT_KINDS[fact.kind].answer) for fact in planted)


# ---------------------------------------------------------------------------------------------- fillers
@dataclass
class Filler:
    """Draws filler turns; remembers questions left for a later turn and the topics already used."""

    rng: random.Random
    pending: list[Turn] = field(default_factory=list)
    used: set[str] = field(default_factory=set)

    def fresh(self, pool: list[str]) -> str:
        """A member of ``pool`` not used yet in this session (when one is left)."""
        left = [item for item in pool if item not in self.used] or pool
        choice = self.rng.choice(left)
        self.used.add(choice)
        return choice

    def turn(self) -> Turn:
        if self.pending and self.rng.random() < 0.5:
            return self.pending.pop(self.rng.randrange(len(self.pending)))
        makers = (
            self.note,
            self.note,
            self.listing,
            self.listing,
            self.relation,
            self.arithmetic,
            self.repeat,
        )
        return self.rng.choice(makers)()

    def note(self) -> Turn:
        r = self.rng
        place = f"{r.choice(ADJECTIVES)} {self.fresh(PLACES)}"
        owner, city, year, colour = (
            _name(r, NAMES),
            r.choice(CITIES),
            r.randint(1500, 2020),
            r.choice(COLOURS),
        )
        count = f"{r.randint(2, 60)} {r.choice(['rooms', 'windows', 'workers', 'lamps'])}"
        hour, word = f"{r.randint(5, 11)} o'clock", r.choice(NOUNS).capitalize()
        facts = [
            (f"Its owner is {owner}.", f"Who owns the {place}?", f"The owner is {owner}."),
            (f"It is in {city}.", f"Where is the {place}?", f"It is in {city}."),
            (f"It was built in {year}.", f"When was the {place} built?", f"It was built in {year}."),
            (f"Its door is painted {colour}.", f"What colour is the door of the {place}?",
             f"The door is painted {colour}."),
            (f"It has {count}.", f"How many {count.split()[1]} does the {place} have?", f"It has {count}."),
            (f"It opens at {hour}.", f"When does the {place} open?", f"It opens at {hour}."),
            (f"The sign above its door says {word}.", f"What does the sign of the {place} say?",
             f"The sign says {word}."),
        ]  # fmt: skip
        chosen = r.sample(facts, r.randint(3, 5))
        doc = " ".join([f"This note is about the {place}."] + [s for s, _, _ in chosen])
        _, question, reply = r.choice(chosen)
        if r.random() < 0.35:
            self.pending.append((question, reply))
            return f"Please keep this note in mind. {doc}", f"I have read the note about the {place}."
        intro = r.choice(["Read this note and answer.", "Here is a short text.", "Consider this document."])
        return f"{intro} {doc} Question: {question}", reply

    def listing(self) -> Turn:
        r = self.rng
        items = r.sample(NOUNS, r.randint(3, 7))
        k = r.randrange(len(items))
        ordinal = "last" if k == len(items) - 1 and r.random() < 0.3 else ORDINALS[k]
        if r.random() < 0.35:
            topic = self.fresh(["shopping", "packing", "camping", "party", "garden", "office"])
            question = f"What was the {ordinal} item on my {topic} list?"
            self.pending.append((question, f"The {ordinal} item on your {topic} list was {items[k]}."))
            return (
                f"Here is my {topic} list: {', '.join(items)}.",
                f"I have saved your list of {len(items)} items.",
            )
        return (
            f"Here is a list: {', '.join(items)}. What is the {ordinal} item?",
            f"The {ordinal} item is {items[k]}.",
        )

    def relation(self) -> Turn:
        r = self.rng
        giver, taker = r.sample(NAMES, 2)
        thing = f"{r.choice(ADJECTIVES)} {r.choice(NOUNS)}"
        story = f"{giver} gave the {thing} to {taker}."
        return r.choice([
            (f"{story} Who received the {thing}?", f"{taker} received the {thing}."),
            (f"{story} Who gave away the {thing}?", f"{giver} gave away the {thing}."),
            (f"{story} What did {giver} give to {taker}?", f"{giver} gave {taker} the {thing}."),
        ])  # fmt: skip

    def arithmetic(self) -> Turn:
        r = self.rng
        a, b, c = (r.randint(1, 20) for _ in range(3))
        if r.random() < 0.3:
            things = self.fresh(COUNTABLES)
            more = f"I just got {b} more {things}. How many {things} do I have now?"
            self.pending.append((more, f"You now have {a + b} {things}."))
            return f"I have {a} {things}.", f"Okay, you have {a} {things}."
        return r.choice([
            (f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."),
            (f"What is {max(a, b)} minus {min(a, b)}?", f"{max(a, b)} minus {min(a, b)} is {abs(a - b)}."),
            (f"Take the numbers {a}, {b} and {c}. Which is the largest?", f"The largest is {max(a, b, c)}."),
        ])  # fmt: skip

    def repeat(self) -> Turn:
        r = self.rng
        if r.random() < 0.25:
            word = r.choice(NOUNS)
            return f"Repeat the word {word} three times.", f"{word} {word} {word}."
        pick = r.choice
        sentence = f"The {pick(ADJECTIVES)} {pick(NOUNS)} {pick(VERBS)} the {pick(ADJECTIVES)} {pick(NOUNS)}."
        ask = r.choice(["Please repeat after me:", "Say this back to me exactly:", "Repeat this sentence:"])
        return f"{ask} {sentence}", sentence


# --------------------------------------------------------------------------------------------- sessions
@dataclass(frozen=True)
class Probe:
    """A user message that asks for a planted fact, with the string its answer must contain."""

    message_index: int
    plant_index: int
    kind: str
    expected: str
    distance: int  # turns between the plant and the probe


@dataclass
class ChatSession:
    """A conversation with reference assistant replies, and its probes."""

    messages: list[Message]
    probes: list[Probe] = field(default_factory=list)

    @property
    def turns(self) -> int:
        """The number of user turns."""
        return sum(m["role"] == "user" for m in self.messages)


class _Builder:
    """Appends turns to a session and remembers where facts were planted."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.filler = Filler(rng)
        self.messages: list[Message] = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
        self.probes: list[Probe] = []
        self.planted: dict[str, tuple[Fact, int, int]] = {}  # kind -> (fact, message index, turn)
        self.turn = 0

    def say(self, turn: Turn) -> int:
        """Append one turn; returns the index of its user message."""
        self.messages += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
        self.turn += 1
        return len(self.messages) - 2

    def plant(self, fact: Fact) -> None:
        self.planted[fact.kind] = (fact, self.say(plant_turn(self.rng, fact)), self.turn)

    def probe(self, kind: str) -> None:
        fact, plant_index, plant_turn_no = self.planted[kind]
        index = self.say(probe_turn(self.rng, fact))
        self.probes.append(Probe(index, plant_index, kind, fact.value, self.turn - plant_turn_no - 1))

    def session(self) -> ChatSession:
        return ChatSession(self.messages, self.probes)


Plan = list[tuple[str, int]]  # ("plant" | "probe" | "fill" | "missing", fact index)


def _schedule(rng: random.Random, n_facts: int, distance: int, lead: int, probe_others: float = 0.7) -> Plan:
    """Fact 0 is probed ``distance`` turns after its plant, after ``lead`` filler turns; the other facts
    are planted (and probed with probability ``probe_others``) at random places around it."""
    plan: Plan = [("fill", -1)] * lead + [("plant", 0)] + [("fill", -1)] * distance + [("probe", 0)]
    for i in range(1, n_facts):
        at = rng.randint(0, len(plan) - 1)
        plan.insert(at, ("plant", i))
        if rng.random() < probe_others:
            plan.insert(rng.randint(at + 1, len(plan)), ("probe", i))
    return plan


def _run(rng: random.Random, plan: Plan, chosen: list[Fact]) -> ChatSession:
    builder = _Builder(rng)
    for action, i in plan:
        if action == "plant":
            builder.plant(chosen[i])
        elif action == "probe":
            builder.probe(chosen[i].kind)
        elif action == "missing":
            builder.say(missing_turn(rng, chosen[i]))
        elif action == "recap":
            builder.say(recap_turn(rng, [fact for fact, _, _ in builder.planted.values()]))
        else:
            builder.say(builder.filler.turn())
    return builder.session()


def training_session(rng: random.Random, max_distance: int = MAX_DISTANCE) -> ChatSession:
    """One training session: 1-4 facts, 0-``max_distance`` filler turns between a plant and its probe,
    fillers around them; sometimes a second probe of a fact, a recap of every fact, and a question about a
    fact never given."""
    n_facts = rng.randint(1, 4)
    plan = _schedule(rng, n_facts, rng.randint(0, max_distance), rng.randint(0, 2), probe_others=0.9)
    if rng.random() < 0.3:
        plan.append(("probe", rng.randrange(n_facts)))
    if n_facts > 1 and rng.random() < 0.3:
        plan.append(("recap", -1))
    if rng.random() < 0.15:
        plan.insert(rng.randint(0, len(plan)), ("missing", n_facts))
    return _run(rng, plan, draw_facts(rng, n_facts + 1))


def training_sessions(n: int, seed: int = TRAIN_SEED) -> list[ChatSession]:
    """``n`` training sessions drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [training_session(rng) for _ in range(n)]


def heldout_session(rng: random.Random, distance: int, lead: int | None = None) -> ChatSession:
    """An evaluation session that ends with its one scored probe (``probes[0]``), asked ``distance`` turns
    after the target fact was planted (after ``lead`` filler turns; 0-1 when None), among 0-3 other facts
    (planted and maybe probed earlier)."""
    n_facts = rng.randint(1, 4)
    plan = _schedule(rng, n_facts, distance, rng.randint(0, 1) if lead is None else lead)
    plan = plan[: plan.index(("probe", 0)) + 1]
    session = _run(rng, plan, draw_facts(rng, n_facts))
    session.probes = session.probes[-1:]
    return session


def heldout_sessions(
    n: int,
    seed: int = HELDOUT_SEED,
    min_distance: int = 0,
    max_distance: int = MAX_DISTANCE,
    fillers: int | None = None,
) -> list[ChatSession]:
    """``n`` evaluation sessions from a seed the training corpus does not use, each ending with its probe,
    whose ``expected`` string the model's reply must contain.

    ``fillers``: long sessions for models with a long context: that many filler turns in each, the target
    fact planted after 0 to ``fillers // 2`` of them (so at least half the session lies between the fact
    and its probe); the distance bounds are then unused. None: the built-in model's sessions (the target
    fact 0-1 turns in, probed ``min_distance``-``max_distance`` turns later)."""
    rng = random.Random(seed)
    if fillers is None:
        return [heldout_session(rng, rng.randint(min_distance, max_distance)) for _ in range(n)]
    if fillers < 0:
        raise ValueError(f"fillers must be >= 0, got {fillers}")
    leads = (rng.randint(0, fillers // 2) for _ in range(n))
    return [heldout_session(rng, fillers - lead, lead) for lead in leads]


def demo_session(seed: int = DEMO_SEED) -> ChatSession:
    """The planted-fact demo: the user's favourite number at turn 1, 12 filler turns, the probe at turn 14."""
    rng = random.Random(seed)
    builder = _Builder(rng)
    builder.plant(Fact("number", str(rng.randint(1000, 9999))))
    for _ in range(12):
        builder.say(builder.filler.turn())
    builder.probe("number")
    return builder.session()

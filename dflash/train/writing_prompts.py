"""Writing requests assembled here from templates (never MT-Bench): a training source for the
long-form prose users ask a chat model for (emails, posts, stories, speeches, role play), the
shape the chat domain's evaluation prompts mostly have and ShareGPT's first turns (spent by
`smollm2-l`) only partly had. Deterministic: the same seed gives the same list, and a longer
list keeps a shorter one as its prefix."""

from __future__ import annotations

import random

FORMS = [
    "a blog post", "a formal email", "a friendly email", "a short story", "a poem", "a product description",
    "a cover letter", "a short speech", "a letter of complaint", "a news article", "a persuasive essay",
    "a diary entry", "a film review", "a book review", "a social media post", "a toast for a celebration",
    "a newsletter introduction", "a press release", "a memo to a team", "a dialogue between two characters",
    "a personal statement", "an opening paragraph for a novel", "a thank-you note", "a motivational message",
    "a restaurant review", "a travel guide entry", "a short fable with a moral", "a scene for a stage play",
    "an advertisement script", "a set of tips", "an op-ed column", "a character sketch", "a limerick",
    "a eulogy for a fictional person", "an apology letter", "a job posting", "a podcast episode outline",
    "a product launch announcement", "a letter to one's future self", "a short mystery story",
]
TOPICS = [
    "learning to play the piano as an adult", "a weekend of hiking in the mountains", "the benefits of working from home",
    "moving to a new city alone", "a small bakery opening in a quiet town", "the first day at a new job",
    "a rainy afternoon in an old library", "why people should adopt shelter animals", "a community garden project",
    "the history of a family recipe", "saving money on groceries", "a night market in a busy city",
    "a lighthouse keeper's last winter", "the joy of cycling to work", "a robot that learns to paint",
    "preparing for a marathon", "a delayed flight and an unexpected friendship", "the importance of sleep",
    "a school science fair", "a cafe that only serves breakfast", "volunteering at a food bank",
    "a village festival in autumn", "switching careers at forty", "an electric car road trip",
    "a museum of forgotten inventions", "learning a second language", "the ocean at dawn",
    "a neighbourhood book exchange", "a new fitness app", "the end of a long friendship", "a lost wallet returned",
    "a startup that recycles old phones", "a grandparent's stories about their youth", "a snowstorm that closed the town",
    "a team that missed an important deadline", "planting trees in a city", "a chess club for teenagers",
    "a trip to a desert observatory", "a houseplant that will not stop growing", "the first snowfall of the year",
    "a company moving to a four-day week", "an old train station turned into a market", "a detective who cannot smell",
    "a campaign to reduce plastic waste", "a musician playing on the street", "a family reunion after ten years",
    "a power cut during a dinner party", "a new public swimming pool", "a scientist's failed experiment",
    "a ferry crossing on a stormy night", "the value of reading fiction", "a mountain village without internet",
    "a lost dog finding its way home", "choosing a first laptop", "a kindness from a stranger",
    "a graduation day", "a local election", "a beekeeper and her hives", "the return of a comet",
    "a noisy upstairs neighbour", "a bicycle repair shop", "an island with one road", "a retiring teacher",
    "time management for students", "a solar-powered boat race", "a second-hand bookshop closing down",
]
TONES = ["warm", "humorous", "formal", "enthusiastic", "calm", "nostalgic", "optimistic", "serious", "playful",
         "respectful"]
AUDIENCES = ["young readers", "busy professionals", "new customers", "a hiring manager", "the local community",
             "first-time visitors", "retired readers", "a group of students", "a company's staff", "close friends"]
STYLES = [
    "Write {form} about {topic}.",
    "Write {form} about {topic}, in a {tone} tone.",
    "Please write {form} about {topic} for {audience}.",
    "Compose {form} on the theme of {topic}. Keep it under {words} words.",
    "I need {form} about {topic}. Make it {tone} and suitable for {audience}.",
    "Could you draft {form} about {topic}? Use concrete details and a clear structure.",
    "Write {form} about {topic}, then give it a title.",
    "Help me write {form} about {topic}. Aim for about {words} words and a {tone} voice.",
]
ROLES = [
    "a travel agent", "a personal trainer", "a museum guide", "a career coach", "a chef", "a history teacher",
    "a park ranger", "a librarian", "a ship's captain", "a gardener", "a customer support agent", "a tour guide",
    "a detective from the 1920s", "a medieval blacksmith", "a weather forecaster", "a wildlife photographer",
]
ROLE_STYLES = [
    "Act as {role}. In character, tell me about {topic}.",
    "You are {role}. Give {audience} advice related to {topic}, staying in role.",
    "Play the part of {role} and describe {topic} as they would, in a {tone} way.",
]


def writing_prompts(n: int = 2000, seed: int = 0) -> list[tuple[str, str]]:
    """(id, user message) pairs, distinct, in a seeded order: one writing request per
    (form or role, topic, style) combination, tone, audience and length drawn per combination,
    role play about one request in eight."""
    rng = random.Random(seed)
    combos = [("form", f, t, s) for f in FORMS for t in TOPICS for s in STYLES]
    combos += [("role", r, t, s) for r in ROLES for t in TOPICS for s in ROLE_STYLES]
    rng.shuffle(combos)
    out, seen = [], set()
    for kind, who, topic, style in combos:
        fill = {"topic": topic, "tone": rng.choice(TONES), "audience": rng.choice(AUDIENCES),
                "words": rng.choice([150, 200, 250, 300])}
        fill["form" if kind == "form" else "role"] = who
        text = style.format(**fill)
        if text not in seen:
            seen.add(text)
            out.append((f"writing-{len(out)}", text))
        if len(out) >= n:
            break
    return out

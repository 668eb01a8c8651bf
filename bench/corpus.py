"""Write ``bench/mixed.jsonl``: the ``mixed`` workload's texts, of long-tailed length.

``python -m bench.corpus`` rewrites the file; ``python -m bench.corpus --check`` says whether
the committed file is what this script writes. Both are deterministic: one seeded
:class:`random.Random` draws every length and every sentence.

Real traffic to a sentence encoder is uneven: search queries and titles of a few words,
questions and reviews of a sentence or two, now and then a whole paragraph. Each text's
length in words is drawn from a log-normal (median :data:`MEDIAN_WORDS`, shape
:data:`SIGMA`), floored at :data:`MIN_WORDS`, redrawn above :data:`MAX_WORDS`; the text is
then composed from the sentences below (written for this benchmark, about everyday
subjects), drawn at random and joined until long enough, and cut to the drawn length.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

import orjson

PATH = Path(__file__).resolve().parent / "mixed.jsonl"
SEED = 14
COUNT = 3000
MEDIAN_WORDS = 16.0
SIGMA = 1.6
MIN_WORDS = 3
MAX_WORDS = 300

SENTENCES = (
    "The bakery on the corner opens at six and sells out of rye bread before nine.",
    "Please reset my password because the link in the last email had already expired.",
    "Our team moved the weekly planning meeting from Monday morning to Tuesday afternoon.",
    "A light rain is expected tonight, followed by a dry and windy weekend.",
    "The museum keeps its older maps in a cool room where the light is always low.",
    "I ordered the blue jacket in a medium, but the parcel contained a large in grey.",
    "Tomatoes grow best with plenty of sun, steady watering and a stake to climb.",
    "The train to the coast was delayed by forty minutes because of a signal fault.",
    "She learned to play the cello at eleven and still practises every evening.",
    "How do I export my contacts to a spreadsheet without losing the phone numbers?",
    "The new library has a quiet floor, a maker space and a small cafe by the entrance.",
    "Interest rates stayed flat this quarter, and most analysts expect no change soon.",
    "Add the onions to the pan and cook them slowly until they turn soft and golden.",
    "The hiking trail climbs steeply for two miles before it reaches the ridge.",
    "Our records show that the invoice was paid twice, so a refund is on its way.",
    "Children at the school planted a row of apple trees along the playground fence.",
    "The laptop battery lasts about nine hours when the screen brightness is turned down.",
    "After the storm, volunteers cleared fallen branches from every street in the village.",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
    "Is there a way to share a calendar with my family without giving them edit rights?",
    "He painted the fence white last summer, and it already needs another coat.",
    "The orchestra will perform three new pieces by local composers next month.",
    "A good night of sleep does more for your memory than an extra hour of study.",
    "The shop extended its return window to sixty days for purchases made in December.",
    "Cats often sleep in the warmest spot of the house, usually near a window.",
    "The bridge will be closed to traffic for repairs from the first to the tenth.",
    "We tested the app on older phones, and it still starts in under two seconds.",
    "Fresh herbs keep longer if you wrap them in a damp towel and store them cold.",
    "The football club signed a young goalkeeper from the second division.",
    "My order number is in the confirmation email, but the tracking page shows nothing.",
    "Solar panels on the roof now cover most of the building's electricity in summer.",
    "The river rose overnight, and the low footpath along the bank is under water.",
    "Please bring a photo ID and a printed copy of your booking to the front desk.",
    "The novel follows two sisters who run a small hotel by the sea.",
    "Regular stretching before a run lowers the chance of a pulled muscle.",
    "The database backup finished at three in the morning and took eleven minutes.",
    "Bees visit the lavender all afternoon, and the garden hums with them in July.",
    "The council voted to add more bicycle lanes on the main roads into town.",
    "Why does the printer say it is offline when it is connected to the same network?",
    "The kettle switches itself off once the water boils, which saves a little energy.",
    "A local farmer sells eggs, honey and seasonal vegetables at the Saturday market.",
    "The conference talk explained how small models can run well on ordinary laptops.",
    "He keeps a notebook by the bed to write down ideas before they fade.",
    "The hotel room was clean and quiet, although the breakfast was rather plain.",
    "Our support team answers most questions within one working day.",
    "The old mill was turned into flats, but the water wheel was kept as it was.",
    "Mix the dressing in a jar with a tight lid and shake it well before serving.",
    "The flight was smooth, and we landed twenty minutes ahead of schedule.",
    "Students can borrow up to ten books at a time for three weeks.",
    "The update fixed the crash on start-up but made the search a little slower.",
    "Autumn leaves clog the gutters, so they should be cleared before the winter rain.",
    "The sales report shows steady growth in the north and a small dip in the south.",
    "I would like to change the delivery address for an order that has not shipped yet.",
    "The puppy learned to sit within a week, but walking on a lead took much longer.",
    "Warm the milk gently, because it burns easily at the bottom of the pot.",
    "The city plans to plant five thousand trees over the next ten years.",
    "The charger gets hot when the phone is charging and playing video at once.",
    "The choir meets in the church hall every Thursday evening at half past seven.",
    "Can I pay for a yearly plan by bank transfer instead of with a credit card?",
    "The path through the woods is muddy after rain, so good boots are a must.",
    "The factory cut its water use by a third after it began recycling the cooling water.",
    "Store the paint in a dry place where it will not freeze during the winter.",
    "She wrote the first draft in a month and then spent a year rewriting it.",
    "The clinic now offers evening appointments twice a week for working patients.",
    "The server ran out of disk space because the log files were never rotated.",
    "A pot of soup made on Sunday can feed a small family for most of the week.",
    "The ferry leaves every hour in summer and every two hours in winter.",
    "Most visitors come for the castle, but the walled garden is the real surprise.",
    "The thermostat lowers the heating at night and warms the house before breakfast.",
    "My package arrived with a torn box, although the item inside was not damaged.",
    "The match was postponed because the pitch was frozen solid.",
    "Small habits, repeated daily, tend to matter more than big plans made once a year.",
    "The form asks for a postcode, but my country does not use postcodes.",
    "The bakery also makes a gluten-free loaf, but only on Fridays.",
    "Engineers replaced the old pumps with quieter ones that use less power.",
    "The festival brings food stalls, street music and a parade through the old town.",
    "If the screen stays black, hold the power button for ten seconds and try again.",
    "The lake is shallow near the shore and safe for small children to paddle in.",
    "Prices at the market rise in winter, when fewer vegetables are in season.",
    "The museum is free on the first Sunday of every month.",
    "She runs a small shop that repairs bicycles and sells second-hand parts.",
    "The weather app warned of fog on the motorway early in the morning.",
    "Our plan includes two users, and each extra user costs a few dollars a month.",
    "The soup tasted better the next day, once the spices had time to settle.",
    "The garden centre has a sale on fruit bushes until the end of the month.",
    "A quiet desk, a good chair and a window can make a long day of work much easier.",
    "The report was late because two of the figures had to be checked again.",
    "Kids in the summer camp built a raft and sailed it across the pond.",
    "Which of these plans includes phone support on weekends?",
    "The cathedral bells ring at noon, and the square fills with people at lunch.",
    "Scientists counted the birds on the island for the tenth year in a row.",
    "The train station has lockers where travellers can leave their bags for the day.",
    "My account was charged, but the subscription still shows as inactive.",
    "The bread is baked in a wood oven, which gives it a dark and crisp crust.",
    "New tenants must give one month of notice before they move out.",
    "The team fixed the bug, added a test for it and shipped the patch the same day.",
    "Strong winds knocked out power to several streets for most of the evening.",
    "Slice the potatoes thinly so they cook evenly in the oven.",
    "The park has a pond with ducks, a playground and a long path for runners.",
    "Old photographs fade faster when they hang in direct sunlight.",
    "The bus driver waited for the last passenger, who was running across the square.",
    "A short walk after dinner helps many people sleep better.",
    "The spreadsheet adds up every column but ignores the cells that contain text.",
    "The village school has only forty pupils, and every teacher knows each child.",
    "Is the discount applied at checkout, or do I need to enter a code?",
    "The coffee machine in the office makes a loud noise but a very good espresso.",
    "Heavy snow closed the mountain pass, and drivers were told to take the valley road.",
    "The cook adds a spoon of vinegar to the lentils just before serving them.",
    "The tenants asked the landlord to fix the leaking tap in the kitchen.",
    "The robot vacuum cleans the living room while we are out at work.",
    "The tennis final lasted almost four hours and ended after sunset.",
    "We keep spare keys with a neighbour in case one of us gets locked out.",
    "The film was long, but the last half hour made up for the slow start.",
    "The map app suggested a shorter route, but it led through a narrow farm lane.",
    "Please confirm whether the meeting room has a projector and a whiteboard.",
    "The harvest was smaller this year because of a dry spring and a wet summer.",
    "Wash new clothes before wearing them, especially those made of dark cotton.",
    "The library app lets members renew their loans and reserve new titles.",
    "The company opened a second office so its staff could work closer to home.",
    "A slow cooker turns cheap cuts of meat tender over a long afternoon.",
    "My headphones connect to the laptop but not to the phone.",
    "The nurse checked the patient's temperature every four hours through the night.",
    "The gallery hangs a new exhibition every season, often by young artists.",
    "The road along the cliffs has sharp bends and wonderful views of the sea.",
    "The price includes delivery, but assembly is charged separately.",
    "The volunteers sort donated food into boxes for families in need every Friday.",
    "The baby finally fell asleep after a long walk in the pram.",
    "The website loads slowly on mobile because the images are far too large.",
    "The science fair had projects on rockets, plants, weather and recycling.",
    "Plant the bulbs in autumn, about twice as deep as they are tall.",
    "The old clock in the hall gains five minutes every week.",
    "A customer asked whether the shoes run small or true to size.",
    "The grocery store now has self-service tills and a shorter queue at lunch.",
    "Our neighbours keep chickens, and sometimes they leave a box of eggs at our door.",
    "The course covers basic statistics, a little programming and how to read charts.",
    "The cyclists stopped at the top of the hill to eat and fill their water bottles.",
    "The refund will appear on your statement within five to seven working days.",
    "The swimming pool is closed for cleaning every Monday morning.",
    "He fixed the wobbly table by folding a piece of card under one leg.",
    "The lighthouse is no longer in use, but visitors can climb to the top.",
    "Add a note to the order if the parcel should be left with a neighbour.",
    "The chef changes the menu every week, depending on what the farmers bring in.",
    "Traffic is heavy on Friday afternoons as people leave the city for the weekend.",
    "The children made paper lanterns and carried them through the streets at dusk.",
    "The thermometer on the balcony read minus four this morning.",
    "The app asks for permission to use the camera only when you scan a code.",
    "A good map and a full water bottle matter more on a long walk than fancy gear.",
    "The printer prints the first page and then stops with a paper jam warning.",
    "The orchard sells cider, apple juice and a dark, sticky apple jam.",
    "The town hall clock was repaired after standing still for nearly a year.",
    "Breakfast is served from seven to ten, and lunch from noon until two.",
    "The student asked for more time to finish the essay because she had been ill.",
    "Our dog barks at the postman every morning and then forgets him completely.",
    "The windows were replaced, and the house is much warmer this winter.",
)


def lengths(rng: random.Random, count: int) -> list[int]:
    """``count`` text lengths in words from the long-tailed distribution above."""
    out: list[int] = []
    while len(out) < count:
        words = round(rng.lognormvariate(math.log(MEDIAN_WORDS), SIGMA))
        if words <= MAX_WORDS:  # a redraw keeps the tail smooth up to the cap
            out.append(max(MIN_WORDS, words))
    return out


def compose(rng: random.Random, words: int) -> str:
    """A text of exactly ``words`` words: random sentences joined, then cut."""
    taken: list[str] = []
    while len(taken) < words:
        taken += rng.choice(SENTENCES).split()
    text = " ".join(taken[:words])
    return text if text.endswith((".", "?")) else text.rstrip(",") + "."


def texts() -> list[str]:
    """The whole corpus, in the order the file holds it."""
    rng = random.Random(SEED)
    return [compose(rng, n) for n in lengths(rng, COUNT)]


def render() -> bytes:
    """The file's bytes: one ``{"text": ...}`` JSON object per line."""
    return b"".join(orjson.dumps({"text": t}) + b"\n" for t in texts())


def summary(words: list[int]) -> str:
    """min / median / p90 / p99 / max words, and the share over 150 words."""
    ordered = sorted(words)

    def at(q: float) -> int:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    over = sum(1 for w in ordered if w > 150) / len(ordered)
    return (
        f"{len(ordered)} texts; words min {ordered[0]}, median {statistics.median(ordered):g}, "
        f"p90 {at(0.9)}, p99 {at(0.99)}, max {ordered[-1]}; {over:.1%} over 150"
    )


def main(argv: list[str] | None = None) -> None:
    """Write the corpus (or, with ``--check``, compare it with the committed file)."""
    parser = argparse.ArgumentParser(prog="python -m bench.corpus", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    data = render()
    if args.check:
        if not PATH.exists() or PATH.read_bytes() != data:
            sys.exit(f"{PATH} differs from what `python -m bench.corpus` writes")
    else:
        PATH.write_bytes(data)
    print(f"{PATH.name}: {len(data) / 1024:.0f} KiB, {summary([len(t.split()) for t in texts()])}")


if __name__ == "__main__":
    main()

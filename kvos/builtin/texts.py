"""The built-in calibration texts: twenty short, varied pieces written for kvos (narrative, dialogue, code,
lists, technical prose, numbers, logs, letters), each a few hundred words, so that attention is measured on
the kinds of text a KV cache holds. Used by ``kvos calibrate`` when no ``--text`` is given."""

from __future__ import annotations

CALIBRATION_TEXTS: dict[str, str] = {}

CALIBRATION_TEXTS["lighthouse"] = """\
The lighthouse on Gannet Point had been automated for eleven years before Maren Holt came back to it. The
council had sold the keeper's cottage to her for the price of a secondhand car, on the condition that she
keep the path to the tower clear and report any fault in the lamp. She arrived in late October with two
suitcases, a box of tools and a cat that refused to leave its basket for three days.

The cottage smelled of salt and old paint. In the kitchen she found a logbook on a shelf above the stove,
its last entry written in pencil: "Wind north-east, force six. Lamp steady. Gull on the gallery rail again."
The handwriting was her grandfather's. She had not known the book still existed.

Each evening she climbed the hundred and twelve steps to watch the lamp come on. It did not need her. A
light sensor and a small computer in a grey cabinet decided when darkness had fallen, and the lens began to
turn with a soft mechanical hum. Still, she liked to be there when it happened, the way some people like to
be at the station when a train they are not catching leaves on time.

In November a storm took the power out along the whole coast. The backup batteries held for six hours and
then the lamp went dark. Maren found the diesel generator behind the oil store, read its manual by torchlight,
bled the fuel line twice, and on the third pull it caught. At four in the morning the beam swept the water
again. A fishing boat that had been waiting off the reef turned for the harbour.

She wrote it in the logbook under her grandfather's last line: "Power lost 22:10. Generator started 03:52.
Lamp steady. Gull on the gallery rail again."
"""

CALIBRATION_TEXTS["market_dialogue"] = """\
"How much for the pears?"
"Three for two euros, or a kilo for three fifty."
"A kilo is how many, roughly?"
"Depends on the pear. These big ones, maybe five. The small ones, seven or eight."
"Then I'll take the small ones. More pears for the money."
"That's what everybody says until they have to peel them."
"I don't peel pears."
"Then you're a sensible person. Here, I'll give you a kilo and a bit. Are you cooking with them?"
"A tart, on Sunday. My sister is visiting and she only eats dessert if it has fruit in it."
"Then you want these, not those. These ones hold their shape in the oven. Those go soft and sad."
"How do you know which is which?"
"Thirty years at this stall. And my mother before me. You press near the stem, like this. If it gives a
little, it's ready to eat. If it gives a lot, it's ready for jam. If it gives nothing, wait two days."
"What about the apples?"
"The red ones are from the valley, sweet, good for children. The green ones are sharp. For a tart with pears
you could add one green apple, just one, cut thin. It wakes the pears up."
"You should write a cookbook."
"I tried once. I got as far as the title."
"What was the title?"
"'Press Near the Stem.' Then my grandson said nobody would buy a book that sounds like instructions for a
doorbell. So I went back to selling pears."
"Well, I would buy it. How much do I owe you?"
"Three fifty for the pears, eighty cents for the apple. Call it four and a quarter."
"Here's five."
"And seventy-five back. Come and tell me how the tart turns out."
"I will, if my sister leaves any."
"""

CALIBRATION_TEXTS["python_inventory"] = """\
from dataclasses import dataclass, field


@dataclass
class Item:
    sku: str
    name: str
    quantity: int = 0
    reorder_level: int = 5
    tags: list[str] = field(default_factory=list)

    def needs_reorder(self) -> bool:
        return self.quantity <= self.reorder_level


class Inventory:
    def __init__(self) -> None:
        self._items: dict[str, Item] = {}
        self._history: list[tuple[str, int]] = []

    def add(self, item: Item) -> None:
        if item.sku in self._items:
            raise KeyError(f"duplicate sku {item.sku}")
        self._items[item.sku] = item

    def receive(self, sku: str, count: int) -> int:
        if count <= 0:
            raise ValueError("count must be positive")
        item = self._items[sku]
        item.quantity += count
        self._history.append((sku, count))
        return item.quantity

    def ship(self, sku: str, count: int) -> int:
        item = self._items[sku]
        if count > item.quantity:
            raise ValueError(f"only {item.quantity} of {sku} in stock, cannot ship {count}")
        item.quantity -= count
        self._history.append((sku, -count))
        return item.quantity

    def low_stock(self) -> list[Item]:
        return sorted(
            (item for item in self._items.values() if item.needs_reorder()),
            key=lambda item: item.quantity,
        )

    def by_tag(self, tag: str) -> list[str]:
        return [item.sku for item in self._items.values() if tag in item.tags]

    def net_movement(self, sku: str) -> int:
        return sum(delta for code, delta in self._history if code == sku)


if __name__ == "__main__":
    stock = Inventory()
    stock.add(Item("B-100", "brass hinge", 40, 10, ["hardware", "door"]))
    stock.add(Item("S-220", "wood screw 4x30", 900, 200, ["hardware"]))
    stock.add(Item("G-015", "wood glue 250ml", 6, 8, ["adhesive"]))
    stock.ship("B-100", 35)
    stock.receive("G-015", 12)
    for item in stock.low_stock():
        print(item.sku, item.name, item.quantity)
    print(stock.by_tag("hardware"), stock.net_movement("B-100"))
"""

CALIBRATION_TEXTS["packing_list"] = """\
Packing list for the four-day hike along the northern ridge

Shelter and sleep
1. Tent, two-person, with footprint and eight pegs
2. Sleeping bag rated to minus five degrees
3. Inflatable mat and its repair patch
4. Small pillow, or a stuff sack filled with the fleece

Cooking and water
5. Gas stove, lighter, and one spare canister (230 g)
6. Pot with lid, one spoon each, one folding bowl each
7. Water filter and two one-litre bottles
8. Collapsible three-litre bag for camp water
9. Biodegradable soap in a small bottle, and a scrubber

Food, per person
10. Four breakfasts: oats, milk powder, raisins
11. Four lunches: flatbread, hard cheese, salami, nuts
12. Three dinners: dried pasta, sauce packets, lentil soup
13. Snacks: chocolate, dried apricots, two energy bars a day
14. Tea bags, instant coffee, sugar sticks

Clothing
15. Waterproof jacket and trousers
16. One warm fleece, one thin base layer
17. Two pairs of hiking socks, one pair of camp socks
18. Hat, gloves, sunglasses, buff

Safety and navigation
19. Paper map of the ridge at 1:25,000, in a map case
20. Compass, and the phone with offline maps downloaded
21. First aid kit: blister plasters, bandage, painkillers, tweezers
22. Head torch with fresh batteries, plus one spare set
23. Whistle, emergency blanket, and the route left with someone at home

Notes
- The ridge has no water between the second and third camps, so carry four litres on day three.
- Check the forecast on the morning of day one; turn back if winds above 60 km/h are expected.
- Total pack weight should stay under 13 kg each; weigh the packs the night before.
"""

CALIBRATION_TEXTS["cache_prose"] = """\
A cache works because programs are predictable in a particular way: the data they touched a moment ago is
likely to be touched again soon, and the data stored next to it is likely to be touched next. The first
property is called temporal locality and the second spatial locality. Hardware caches exploit both. When a
processor reads one word from memory, the cache fetches the whole line that contains it, typically sixty-four
bytes, betting that the neighbouring words will be wanted shortly.

The difficulty comes when the cache is full and something must leave. A replacement policy decides which
entry to evict. Least recently used is the classic answer: throw out whatever has gone longest without being
touched. It is simple to describe, but exact tracking is expensive, so real systems approximate it with a
clock hand that sweeps over reference bits, or with a few bits of age per way.

No single policy is best for every workload. A program that scans a large array once will flush a least
recently used cache of everything useful, because every new element looks more recent than the hot data it
displaces. Policies such as those that insert new lines at a low priority and promote them only on a second
use were designed for exactly this case.

Software caches face the same trade-offs with different costs. A web cache measures misses in milliseconds
rather than nanoseconds, so it can afford richer bookkeeping: frequency counts, object sizes, the cost of
fetching each object again. The question is always the same, however. Given limited space, which items will
be needed again, and what does it cost to get them back if the guess is wrong? A good policy answers with
evidence from the past, and a good system measures how often that evidence turns out to be right.
"""

CALIBRATION_TEXTS["ledger"] = """\
Monthly household ledger, March

Date    Description                  Category      Amount     Balance
03-01   Opening balance              -                        2,418.60
03-01   Rent                         housing       -950.00    1,468.60
03-02   Salary                       income      +2,730.00    4,198.60
03-03   Supermarket                  food           -86.45    4,112.15
03-05   Electricity, February        utilities      -64.20    4,047.95
03-06   Bus pass                     transport      -49.00    3,998.95
03-08   Bakery                       food            -7.80    3,991.15
03-09   Phone                        utilities      -21.99    3,969.16
03-11   Supermarket                  food           -73.10    3,896.06
03-12   Dentist                      health         -45.00    3,851.06
03-14   Birthday present for Ana     gifts          -38.50    3,812.56
03-15   Savings transfer             savings       -400.00    3,412.56
03-17   Cinema, two tickets          leisure        -22.00    3,390.56
03-18   Supermarket                  food           -91.27    3,299.29
03-20   Water, quarter               utilities      -58.40    3,240.89
03-22   Refund, returned jacket      income         +59.95    3,300.84
03-23   Hardware shop                home           -17.35    3,283.49
03-25   Supermarket                  food           -68.92    3,214.57
03-27   Internet                     utilities      -35.00    3,179.57
03-29   Restaurant                   leisure        -54.60    3,124.97
03-31   Closing balance              -                        3,124.97

Totals by category
food         -327.54
utilities    -179.59
housing      -950.00
transport     -49.00
health        -45.00
gifts         -38.50
leisure       -76.60
home          -17.35
savings      -400.00
income     +2,789.95

Net change for the month: +706.37. Food spending was 4.1 percent lower than in February (341.60).
Savings this year so far: 1,200.00 of the 4,800.00 target, which is 25.0 percent after three months.
"""

CALIBRATION_TEXTS["support_chat"] = """\
User: Hi, my printer says it is offline but it is switched on and the light is green.
Assistant: Let's check the connection first. Is the printer connected by a cable or over Wi-Fi?
User: Wi-Fi. It worked yesterday.
Assistant: Did anything change since yesterday, such as a router restart or a new password?
User: The internet company came this morning and replaced the router.
Assistant: That explains it. A new router usually has a new network name or password, so the printer is
still trying to join the old network. On the printer's control panel, open Settings, then Network, then
Wireless Setup Wizard. Does it show a list of networks?
User: Yes. I see three networks. One of them has the name printed on the new router's sticker.
Assistant: Choose that one and enter the password from the same sticker. Careful with capital letters,
and with zero versus the letter O.
User: It is connecting... it says connected, signal strength good.
Assistant: Now on your computer, open the list of printers. The old entry may still point at the printer's
previous address. Try printing a test page.
User: The test page is stuck in the queue.
Assistant: Remove the printer from the list and add it again; the computer will find it at its new address.
User: Done. It found it straight away and the page is printing.
Assistant: Good. To avoid this next time, you could give the printer a fixed address in the router's
settings, but that is optional. Is there anything else you need?
User: No, that's all. Thank you, I would never have guessed it was the router.
Assistant: You're welcome. Have a good day.
"""

CALIBRATION_TEXTS["sql_report"] = """\
-- Weekly sales report: revenue, orders and average basket per store, with week-over-week change.
WITH weekly AS (
    SELECT
        s.store_id,
        s.city,
        date_trunc('week', o.created_at) AS week,
        count(DISTINCT o.order_id) AS orders,
        sum(li.quantity * li.unit_price) AS revenue
    FROM orders AS o
    JOIN line_items AS li ON li.order_id = o.order_id
    JOIN stores AS s ON s.store_id = o.store_id
    WHERE o.status = 'completed'
      AND o.created_at >= now() - interval '8 weeks'
    GROUP BY s.store_id, s.city, date_trunc('week', o.created_at)
),
ranked AS (
    SELECT
        *,
        revenue / nullif(orders, 0) AS avg_basket,
        lag(revenue) OVER (PARTITION BY store_id ORDER BY week) AS prev_revenue
    FROM weekly
)
SELECT
    city,
    store_id,
    to_char(week, 'YYYY-MM-DD') AS week_start,
    orders,
    round(revenue, 2) AS revenue,
    round(avg_basket, 2) AS avg_basket,
    CASE
        WHEN prev_revenue IS NULL THEN NULL
        ELSE round(100.0 * (revenue - prev_revenue) / prev_revenue, 1)
    END AS change_pct
FROM ranked
WHERE week >= now() - interval '4 weeks'
ORDER BY city, store_id, week;

-- Stores whose revenue fell three weeks in a row.
SELECT store_id, city
FROM (
    SELECT
        store_id,
        city,
        revenue < lag(revenue, 1) OVER w
            AND lag(revenue, 1) OVER w < lag(revenue, 2) OVER w
            AND lag(revenue, 2) OVER w < lag(revenue, 3) OVER w AS falling
    FROM weekly
    WINDOW w AS (PARTITION BY store_id ORDER BY week)
) AS t
WHERE falling
GROUP BY store_id, city;
"""

CALIBRATION_TEXTS["recipe"] = """\
Barley and mushroom soup (serves four)

Ingredients: 150 grams of pearl barley, 400 grams of brown mushrooms, one large onion, two carrots, two sticks
of celery, three cloves of garlic, two tablespoons of olive oil, one tablespoon of butter, a sprig of thyme,
two bay leaves, one and a half litres of vegetable stock, a splash of soy sauce, salt, black pepper, and a
handful of chopped parsley to finish.

Rinse the barley in a sieve under cold water until the water runs clear. This takes about a minute and
removes the loose starch that would otherwise make the soup gluey.

Dice the onion, carrots and celery into pieces about the size of a fingernail. Slice the mushrooms thickly;
they shrink a great deal. Crush the garlic.

Warm the oil and butter in a heavy pot over medium heat. Add the onion, carrots and celery with a pinch of
salt and cook for eight to ten minutes, stirring now and then, until the onion is soft and sweet but not
brown. Turn the heat up, add the mushrooms, and leave them alone for two minutes so they colour before you
stir. Cook until their liquid has evaporated, then add the garlic and thyme for one more minute.

Add the barley, the bay leaves and the stock. Bring to the boil, lower the heat, cover partly and simmer for
forty minutes, until the barley is tender but still has a little bite. If the soup gets too thick, add a
cup of water. Remove the bay leaves and the thyme stalk.

Season with the soy sauce, salt and plenty of pepper. Taste again after a minute: barley absorbs salt. Serve
with the parsley on top and bread on the side. The soup keeps for three days in the fridge and thickens
overnight, so thin it with water when reheating.
"""

CALIBRATION_TEXTS["server_log"] = """\
2024-05-14 09:00:01 INFO  api       listening on 0.0.0.0:8080 with 8 workers
2024-05-14 09:00:02 INFO  db        pool ready: 20 connections to primary, 10 to replica
2024-05-14 09:02:17 INFO  api       GET /v1/orders?page=1 200 38ms user=4412
2024-05-14 09:02:19 INFO  api       GET /v1/orders/88231 200 12ms user=4412
2024-05-14 09:03:44 WARN  api       POST /v1/payments 429 2ms user=9001 reason=rate_limited
2024-05-14 09:05:10 INFO  worker    job email.send id=5521 done in 340ms
2024-05-14 09:05:11 INFO  worker    job email.send id=5522 done in 295ms
2024-05-14 09:07:58 ERROR db        query timeout after 5000ms: SELECT * FROM invoices WHERE customer_id = $1
2024-05-14 09:07:58 ERROR api       GET /v1/invoices?customer=311 500 5004ms user=311
2024-05-14 09:08:03 WARN  db        replica lag 4.2s exceeds threshold 2.0s
2024-05-14 09:08:30 WARN  db        replica lag 6.8s exceeds threshold 2.0s
2024-05-14 09:09:12 INFO  ops       autovacuum started on table invoices (dead tuples 1.2M)
2024-05-14 09:11:45 INFO  ops       autovacuum finished on table invoices in 153s
2024-05-14 09:11:50 INFO  db        replica lag 0.3s
2024-05-14 09:12:02 INFO  api       GET /v1/invoices?customer=311 200 41ms user=311
2024-05-14 09:15:00 INFO  cron      nightly-report skipped: not scheduled until 02:00
2024-05-14 09:16:27 WARN  worker    job pdf.render id=5530 retry 1/3: font cache missing
2024-05-14 09:16:29 INFO  worker    job pdf.render id=5530 done in 1880ms
2024-05-14 09:20:41 INFO  api       POST /v1/payments 201 96ms user=9001
2024-05-14 09:21:03 ERROR worker    job webhook.deliver id=5534 failed: connection refused by partner host
2024-05-14 09:21:33 ERROR worker    job webhook.deliver id=5534 failed: connection refused by partner host
2024-05-14 09:22:03 WARN  worker    job webhook.deliver id=5534 moved to dead letter queue after 3 attempts
2024-05-14 09:25:00 INFO  metrics   p50=31ms p95=180ms p99=2100ms errors=0.4% rps=212
2024-05-14 09:30:00 INFO  metrics   p50=29ms p95=120ms p99=340ms errors=0.0% rps=198
"""

CALIBRATION_TEXTS["letter"] = """\
Dear Tomas,

Thank you for your letter and for the photographs of the new orchard. I could hardly believe the little
trees in the picture are the same ones we planted in the rain two winters ago, when you kept saying that
at least half of them would die. Only one did, as far as I can tell, and you have already replaced it.

Things here are quieter than usual. The school closed for a week because the heating failed, and the
children spent the time building a raft from pallets and empty water barrels. It floated, which surprised
everyone, including the children. It also sank, but only after the third passenger climbed on, which they
have decided counts as a success. I have been told the second version will be finished by the summer.

I have finally started the work on the barn roof. The old tiles came off more easily than I expected, and
underneath most of the beams are sound. Two of them will need replacing, and the carpenter from the village
says he can cut them in oak if I wait until May. I said yes. A roof should be done once and done properly,
as your father used to say whenever he was about to do something the slow way.

Mother is well. She walks to the river every morning with the dog and comes back with opinions about the
neighbours' gardens. She asks whether you will visit in August, and I told her I would ask you, so consider
yourself asked. There is a bed in the small room, and the apples should be ready by then, if the wasps
leave us any.

Write soon, and tell me how the bees are doing.

With love,
Ilse
"""

CALIBRATION_TEXTS["c_ring_buffer"] = """\
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* A fixed-capacity ring buffer of bytes. Capacity must be a power of two. */
typedef struct {
    uint8_t *data;
    size_t capacity;
    size_t head; /* next write position */
    size_t tail; /* next read position */
} ring_t;

int ring_init(ring_t *r, uint8_t *storage, size_t capacity) {
    if (capacity == 0 || (capacity & (capacity - 1)) != 0) {
        return -1;
    }
    r->data = storage;
    r->capacity = capacity;
    r->head = 0;
    r->tail = 0;
    return 0;
}

size_t ring_used(const ring_t *r) {
    return r->head - r->tail;
}

size_t ring_free(const ring_t *r) {
    return r->capacity - ring_used(r);
}

size_t ring_write(ring_t *r, const uint8_t *src, size_t n) {
    size_t room = ring_free(r);
    if (n > room) {
        n = room;
    }
    size_t start = r->head & (r->capacity - 1);
    size_t first = r->capacity - start;
    if (first > n) {
        first = n;
    }
    memcpy(r->data + start, src, first);
    memcpy(r->data, src + first, n - first);
    r->head += n;
    return n;
}

size_t ring_read(ring_t *r, uint8_t *dst, size_t n) {
    size_t avail = ring_used(r);
    if (n > avail) {
        n = avail;
    }
    size_t start = r->tail & (r->capacity - 1);
    size_t first = r->capacity - start;
    if (first > n) {
        first = n;
    }
    memcpy(dst, r->data + start, first);
    memcpy(dst + first, r->data, n - first);
    r->tail += n;
    return n;
}

/* head and tail only grow; unsigned wrap-around keeps head - tail correct. */
"""

CALIBRATION_TEXTS["meeting_notes"] = """\
Project Kestrel: weekly meeting notes
Attendees: Priya (lead), Jonas (backend), Keiko (frontend), Farid (QA), Wen (design). Absent: Oscar.

1. Status of the release candidate
- Jonas: the new export endpoint is merged; the CSV and JSON formats both pass the contract tests. The
  streaming version for very large exports is still behind a flag because memory use grows with the number
  of columns. He expects a fix by Thursday.
- Keiko: the settings page redesign is done except for the dark theme, where two contrast ratios fail the
  accessibility check. Wen will send adjusted colours today.
- Farid: 41 of 44 regression tests pass. The three failures are all in the date picker and look like a
  timezone problem on machines set to UTC+13.

2. Decisions
- The release moves from Monday to Wednesday, so that the date picker fix can be tested for two full days.
- The streaming export stays behind the flag for this release, whatever happens on Thursday.
- From next sprint on, every pull request that changes the public API needs a note in the changelog.

3. Risks
- The payment provider will deprecate the old webhook format at the end of next month. Nobody has started
  the migration. Priya will ask Oscar to estimate it when he is back.
- Two customers asked for single sign-on; it is not planned before the third quarter.

4. Action items
- Wen: dark theme colours to Keiko, today.
- Jonas: memory fix for streaming export, Thursday.
- Farid: reproduce the date picker failure with a fixed clock, tomorrow.
- Priya: move the release date in the calendar and tell support, today.
- Keiko: update the screenshots in the help pages after the colour change.

Next meeting: Tuesday at 10:00, same room. Farid will run it, as Priya is travelling.
"""

CALIBRATION_TEXTS["config_json"] = """\
{
  "service": "thumbnailer",
  "version": "2.3.1",
  "listen": {"host": "0.0.0.0", "port": 9090, "tls": false},
  "storage": {
    "backend": "s3",
    "bucket": "media-thumbs",
    "region": "eu-west-1",
    "prefix": "v2/",
    "max_object_bytes": 10485760
  },
  "sizes": [
    {"name": "small", "width": 160, "height": 160, "crop": true, "quality": 78},
    {"name": "medium", "width": 480, "height": 360, "crop": false, "quality": 82},
    {"name": "large", "width": 1280, "height": 960, "crop": false, "quality": 85},
    {"name": "square", "width": 600, "height": 600, "crop": true, "quality": 84}
  ],
  "formats": {"accept": ["jpeg", "png", "webp", "gif"], "output": "webp", "keep_animation": false},
  "limits": {
    "max_input_pixels": 50000000,
    "timeout_seconds": 20,
    "concurrency": 8,
    "queue_length": 500
  },
  "cache": {"enabled": true, "ttl_seconds": 86400, "max_entries": 20000},
  "retry": {"attempts": 3, "backoff_ms": [200, 800, 3200]},
  "logging": {"level": "info", "format": "json", "sample_rate": 0.1},
  "metrics": {"enabled": true, "path": "/metrics", "buckets_ms": [5, 10, 25, 50, 100, 250, 500, 1000]},
  "features": {
    "face_aware_crop": true,
    "strip_metadata": true,
    "progressive_jpeg": false,
    "lossless_png_passthrough": true
  },
  "owners": [
    {"team": "media-platform", "oncall": "media-oncall", "escalation_minutes": 15},
    {"team": "storage", "oncall": "storage-oncall", "escalation_minutes": 30}
  ]
}
"""

CALIBRATION_TEXTS["proof"] = """\
Claim. For every positive integer n, the sum of the first n odd numbers equals n squared:
1 + 3 + 5 + ... + (2n - 1) = n^2.

Proof by induction. For n = 1 the sum has a single term, 1, and 1^2 = 1, so the claim holds.

Suppose the claim holds for some n >= 1, that is, 1 + 3 + ... + (2n - 1) = n^2. The sum of the first n + 1
odd numbers is that sum plus the next odd number, 2(n + 1) - 1 = 2n + 1. By the assumption it equals
n^2 + 2n + 1, which is (n + 1)^2. So the claim holds for n + 1, and by induction for every positive n.

A second proof, without induction. Arrange n^2 dots in an n by n square. Peel the square into L-shaped
layers, starting from the top-left corner: the first layer is the single corner dot, the second adds a row
and a column of one dot each around it plus the new corner, three dots in all, and the k-th layer has
(k - 1) + (k - 1) + 1 = 2k - 1 dots. The n layers together cover the square, so their sizes, the first n odd
numbers, add up to n^2.

A consequence. The difference between consecutive squares is odd: (n + 1)^2 - n^2 = 2n + 1. Hence between
n^2 and (n + 1)^2 there are exactly 2n integers that are not squares. For example, between 25 and 36 the
non-squares are 26, 27, 28, 29, 30, 31, 32, 33, 34 and 35, ten numbers, and 2 x 5 = 10.

Exercise. Show that the sum of the first n even numbers, 2 + 4 + ... + 2n, equals n(n + 1), first by
induction and then by comparing it term by term with the sum of the first n odd numbers.
"""

CALIBRATION_TEXTS["train_timetable"] = """\
Regional line R7, weekday timetable (valid from 2 September)

Station           R7-101  R7-103  R7-105  R7-107  R7-109  R7-111  R7-113
Harbour Central    05:42   06:12   06:42   07:12   07:42   08:12   08:42
Old Town           05:46   06:16   06:46   07:16   07:46   08:16   08:46
University         05:51   06:21   06:51   07:21   07:51   08:21   08:51
Riverside Park     05:55   06:25   06:55   07:25   07:55   08:25   08:55
Millbrook          06:03   06:33   07:03   07:33   08:03   08:33   09:03
Ashford Junction   06:10   06:40   07:10   07:40   08:10   08:40   09:10
Kellerby           06:18   06:48   07:18   07:48   08:18   08:48   09:18
Stonegate          06:24   06:54   07:24   07:54   08:24   08:54   09:24
Airport            06:31   07:01   07:31   08:01   08:31   09:01   09:31

Notes
- Trains R7-105 and R7-107 run with six carriages; all others have four.
- At Ashford Junction, connections to the coastal line C2 leave from platform 3, eight minutes after the
  R7 arrives. The last connection of the morning is at 09:18.
- Between 10:00 and 15:00 trains run every hour, at 42 minutes past, from Harbour Central.
- Journey time from Harbour Central to the Airport is 49 minutes; a single ticket costs 6.40, a day ticket
  11.20, and a monthly pass 118.00. Children under 12 travel for half price.
- Works on the Millbrook bridge: on 14, 15 and 16 October, replacement buses run between Riverside Park and
  Ashford Junction and add about 20 minutes to the journey.
- Bicycles are allowed on all trains except R7-105 and R7-107 between 06:30 and 08:30.
"""

CALIBRATION_TEXTS["fable"] = """\
A crow who lived on the edge of a wheat field had a habit of counting. She counted the sparrows on the
fence, the clouds that passed over the barn, and the seeds the farmer dropped when he walked back from the
mill. She did not know why she counted. It simply seemed wrong to look at a thing and not know how many of
it there were.

One autumn the farmer's son set out a row of scarecrows, seven of them, each in an old coat. The sparrows
fled. The pigeons fled. The crow counted the scarecrows, seven, and sat on the fence to think.

On the first day she watched the scarecrows from dawn until dusk. None of them moved. On the second day a
gust of wind flapped the sleeve of the third one and she flinched, but it did not move again. On the third
day she noticed that the farmer's son came out each evening, walked along the row, and went back in. Each
evening there were seven scarecrows when he came out and seven when he left.

On the fourth evening she counted eight.

She looked carefully. The eighth stood at the end of the row in a brown coat, and its hat was tilted in a
way that a stick and a sack could not tilt a hat. She stayed on the fence. The sparrows, who never counted
anything, saw that the birds had been safe for three days and flew down into the wheat. The eighth
scarecrow jumped up with a shout and a net, and the sparrows scattered, furious.

The next morning there were seven scarecrows again, and the crow went down and ate her fill.

Knowing how many there should be is the beginning of noticing what is wrong.
"""

CALIBRATION_TEXTS["faq"] = """\
Frequently asked questions about the community tool library

Who can borrow tools?
Anyone who lives or works in the district and has registered at the front desk with proof of address.
Registration is free and takes about five minutes.

How many tools can I borrow at once?
Up to three items at a time. Large items, such as the cement mixer, the tile cutter and the long ladder,
count as two items each.

How long can I keep a tool?
One week for most tools. You can extend the loan once, by another week, by phone or at the desk, as long
as nobody else has reserved the tool.

What happens if I return a tool late?
There is no fine, but after two late returns in a year your borrowing limit drops to one item for three
months. We prefer a message to silence: if you are running late, tell us.

What if a tool breaks while I am using it?
Bring it back and tell us what happened. Tools wear out and we expect some breakage. We only ask for a
contribution to the repair if the damage was clearly caused by misuse, for example cutting metal with a
wood saw.

Do you provide blades, bits and consumables?
Each drill comes with a basic set of bits, and each saw has a blade fitted. Sandpaper, screws, paint and
other consumables are not included, but there is a small swap shelf by the door where people leave
leftovers.

Can I learn how to use a tool?
Yes. Volunteers run a free workshop on the first Saturday of every month, from ten until noon, covering
a different tool each time. You can also ask at the desk for a quick demonstration before you borrow.

How is the library funded?
By a grant from the district council, donations of tools, and a yearly repair café that raises money for
replacement parts.
"""

CALIBRATION_TEXTS["js_debounce"] = """\
// Utilities for user interfaces: debounce, throttle and a tiny event emitter.

export function debounce(fn, waitMs) {
  let timer = null;
  return function debounced(...args) {
    if (timer !== null) {
      clearTimeout(timer);
    }
    timer = setTimeout(() => {
      timer = null;
      fn.apply(this, args);
    }, waitMs);
  };
}

export function throttle(fn, intervalMs) {
  let last = 0;
  let pending = null;
  return function throttled(...args) {
    const now = Date.now();
    const remaining = intervalMs - (now - last);
    if (remaining <= 0) {
      last = now;
      fn.apply(this, args);
    } else if (pending === null) {
      pending = setTimeout(() => {
        pending = null;
        last = Date.now();
        fn.apply(this, args);
      }, remaining);
    }
  };
}

export class Emitter {
  constructor() {
    this.handlers = new Map();
  }

  on(event, handler) {
    if (!this.handlers.has(event)) {
      this.handlers.set(event, new Set());
    }
    this.handlers.get(event).add(handler);
    return () => this.off(event, handler);
  }

  off(event, handler) {
    const set = this.handlers.get(event);
    if (set) {
      set.delete(handler);
      if (set.size === 0) {
        this.handlers.delete(event);
      }
    }
  }

  emit(event, payload) {
    const set = this.handlers.get(event);
    if (!set) {
      return 0;
    }
    for (const handler of [...set]) {
      handler(payload);
    }
    return set.size;
  }
}

// Example: save a draft at most once per second while the user types.
const bus = new Emitter();
const save = throttle((text) => console.log("saved", text.length, "characters"), 1000);
bus.on("input", debounce(save, 250));
"""

CALIBRATION_TEXTS["field_report"] = """\
Field report: river survey, upper reach, 6 to 8 June

Three of us walked the upper reach of the river from the mill weir to the spring, a distance of 7.4
kilometres, recording the channel, the banks and anything that blocked the flow. The weather was dry and
the water level low, 31 centimetres at the weir gauge against a June average of 44, which made the bed
easy to see.

Channel. For the first two kilometres the channel is straight and lined with stone, the result of works
done in the last century. Below the footbridge it begins to meander again and the bed changes from cobbles
to gravel and sand. We measured the width at twenty points; it ranged from 2.1 to 6.8 metres, widest at
the two bends below the old sheep wash.

Banks. Erosion is worst on the outside of the bends in the middle section, where cattle come down to drink.
At one place the bank has retreated about a metre since the photographs taken four years ago. Elsewhere
the banks are stable and well vegetated, mostly with alder and willow.

Obstructions. We counted fourteen: nine fallen trees or large branches, three heaps of debris caught on
roots, one collapsed fence, and one shopping trolley, which we removed. Six of the fallen trees create
useful pools and should stay. The other three, together with the debris heaps, are raising the water
upstream and should be cleared before the autumn rains.

Wildlife. We saw a kingfisher twice, a grey wagtail near the spring, and brown trout in most of the deeper
pools. Signs of otter, tracks and droppings, were found at two places below the footbridge.

Recommendations. Fence the cattle access at the two worst bends and provide a drinking point away from the
bank; clear the three trees and the debris; repeat the survey next June.
"""


def calibration_texts() -> list[str]:
    """The built-in calibration texts, in a fixed order."""
    return list(CALIBRATION_TEXTS.values())

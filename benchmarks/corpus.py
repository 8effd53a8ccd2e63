"""A deterministic corpus of realistic sentences, 8-40 words, for benchmarks and load tests."""

from __future__ import annotations

import random

_WORDS = (
    "the a service model request batch token latency network cluster replica encoder attention layer "
    "query key value vector embedding search document customer order payment invoice report weather "
    "city river mountain music film book garden coffee morning evening quickly slowly carefully often "
    "never always because although while after before during between among through across under over "
    "runs reads writes builds finds sends returns improves measures compares explains describes shows "
    "large small fast slow new old simple complex reliable secure modern useful important different "
    "people teams engineers users developers operators students doctors drivers artists scientists"
).split()


def sentences(n: int, min_words: int = 8, max_words: int = 40, seed: int = 0) -> list[str]:
    """n sentences of min..max words, the same for a given seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))]
        out.append(" ".join(words).capitalize() + ".")
    return out


# Sentences in several languages and scripts, the kind of text an embedding service receives:
# product reviews, support questions, news-like statements, search queries.
_MULTILINGUAL = [
    "The delivery arrived two days late, but the support team refunded the shipping cost.",
    "How do I reset my password if I no longer have access to my email account?",
    "Quarterly revenue grew by eleven percent, driven by strong demand in Asia.",
    "best noise cancelling headphones under 200 dollars",
    "Die Lieferung kam zwei Tage zu spät, aber der Kundendienst hat die Versandkosten erstattet.",
    "Wie kann ich mein Passwort zurücksetzen, wenn ich keinen Zugriff mehr auf meine E-Mail habe?",
    "La livraison est arrivée avec deux jours de retard, mais le service client a remboursé les frais.",
    "Comment puis-je changer l'adresse de facturation de mon abonnement ?",
    "El pedido llegó incompleto y todavía no he recibido respuesta del vendedor.",
    "¿Cuál es el horario de atención al cliente durante los días festivos?",
    "O produto chegou rápido e funciona exatamente como descrito no anúncio.",
    "Il treno per Milano è stato cancellato a causa dello sciopero nazionale.",
    "Доставка задержалась на два дня, но служба поддержки вернула стоимость доставки.",
    "配達は二日遅れましたが、サポートチームが送料を返金してくれました。",
    "这家餐厅的服务很好，但是价格有点贵。",
    "배송이 이틀 늦었지만 고객 지원팀이 배송비를 환불해 주었습니다.",
    "Η παράδοση καθυστέρησε δύο ημέρες, αλλά η υποστήριξη επέστρεψε τα μεταφορικά.",
    "Teslimat iki gün gecikti ama destek ekibi kargo ücretini iade etti.",
    "وصل الطلب متأخرا يومين لكن فريق الدعم أعاد رسوم الشحن.",
    "डिलीवरी दो दिन देर से आई, लेकिन सहायता टीम ने शिपिंग शुल्क वापस कर दिया।",
]


def multilingual(n: int, seed: int = 0, long_share: float = 0.05) -> list[str]:
    """n texts: single sentences, short paragraphs, and (long_share of them) texts long enough
    to reach the model's 256-token limit, mixing the languages above with generated English."""
    rng = random.Random(seed)
    english = sentences(n, seed=seed + 1)
    out = []
    for i in range(n):
        r = rng.random()
        if r < long_share:  # near or past the model's maximum: about 300 words
            out.append(" ".join(rng.choice(_MULTILINGUAL) for _ in range(18)))
        elif r < 0.5:
            out.append(rng.choice(_MULTILINGUAL))
        elif r < 0.8:
            out.append(english[i])
        else:
            out.append(" ".join(rng.choice(_MULTILINGUAL) for _ in range(rng.randint(2, 5))))
    return out


def short_texts(n: int, seed: int = 0) -> list[str]:
    """n short texts: one sentence each, half of them from the multilingual ones above, half generated
    English of 8-40 words (what `make bench-request-path` sends: the request path, not the model, is measured)."""
    rng = random.Random(seed)
    english = sentences(n, seed=seed + 1)
    return [rng.choice(_MULTILINGUAL) if rng.random() < 0.5 else english[i] for i in range(n)]

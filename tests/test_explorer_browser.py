"""The explorer page in a real browser (headless Chromium, driven by selenium through chromedriver)
against the real service, and GET / and the page's assets over plain HTTP; the rerank explorer's drawing of
a late-interaction model's MaxSim (and BGE-M3's shared sparse terms), and the explorer's drawing of a sparse
vector, against the representation models' app.

`python -m tests.test_explorer_browser URL OUT.png` captures the explorer of a running service with
a text pair analysed (how docs/explorer.png is made).
"""

from __future__ import annotations

import math
import re
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import quote, urljoin, urlsplit

import httpx
import pytest

from tests.conftest import deploy, wait_until

PACKAGES = "chromium chromium-driver"
TOKEN = "explorer-token-for-tests"
PAIR = ("The cat sat on the mat.", "A cat was sitting on a rug.")
SCREENSHOT = Path("results/explorer.png")
# The one absolute URL an asset may hold: the SVG namespace, a name rather than a place to fetch.
NAMESPACES = {"http://www.w3.org/2000/svg"}


def explorer_url(base: str, *texts: str) -> str:
    return f"{base}/explorer" + ("?" + "&".join(f"text={quote(t)}" for t in texts) if texts else "")


# ---------- the browser ----------


def chromium_driver(width: int = 1400, height: int = 1000):
    """Headless Chromium from the Debian packages, with the console log readable; fails (never skips)
    with one line naming what is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("the browser test needs the Python package selenium: pip install -e '.[test]' (make test does)",
                    pytrace=False)
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        pytest.fail(f"the browser test needs the Debian packages {PACKAGES}: apt-get install {PACKAGES} "
                    "(make test installs them)", pytrace=False)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--hide-scrollbars", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    return driver


@pytest.fixture(scope="module")
def browser():
    driver = chromium_driver()
    yield driver
    driver.quit()


def console_errors(driver) -> list[str]:
    """The console's SEVERE entries since the last call (reading the log empties it)."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def open_page(driver, url: str, analysis: str | None = "done") -> None:
    """Load the page, wait until its start-up (and the analysis the address asks for) is over."""
    driver.get(url)
    try:
        wait_until(lambda: driver.execute_script("return document.body.dataset.ready === 'true'"),
                   f"the explorer at {url} to start", timeout=30, interval=0.05)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\npage: {driver.page_source[:500]}\nconsole: {driver.get_log('browser')}") from None
    state = driver.execute_script("return document.body.dataset.analysis || null")
    error = driver.execute_script("return document.getElementById('error').textContent")
    assert state == analysis, f"analysis state {state!r}, expected {analysis!r}; error shown: {error!r}"


def cell_pixels(driver) -> list[dict]:
    """For every model-view cell: its data attributes, canvas size, luminance spread, and where
    its darkest pixel (the strongest weight) is."""
    return driver.execute_script("""
        return Array.from(document.querySelectorAll('#model-view .cell')).map((c) => {
          const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
          let sum = 0, sq = 0, darkest = Infinity, at = -1, opaque = true;
          for (let p = 0; p < d.length; p += 4) {
            const v = (d[p] + d[p + 1] + d[p + 2]) / 3;
            sum += v; sq += v * v;
            if (v < darkest) { darkest = v; at = p / 4; }
            if (d[p + 3] !== 255) opaque = false;
          }
          const k = d.length / 4, mean = sum / k;
          return {tag: c.tagName, layer: c.dataset.layer, head: c.dataset.head, width: c.width, height: c.height,
                  std: Math.sqrt(Math.max(sq / k - mean * mean, 0)), darkest_at: at, opaque};
        });
    """)


def rgb(css: str) -> tuple[int, int, int]:
    r, g, b = (int(v) for v in re.findall(r"\d+", css)[:3])
    return r, g, b


# ---------- the services ----------


@pytest.fixture(scope="module")
def info(service_url) -> dict:
    return httpx.get(f"{service_url}/info", timeout=30).json()


@pytest.fixture(scope="module")
def secured_url(ray_serve, default_bundle, tmp_path_factory):
    """The app again, with bearer auth on, under a route prefix (so the page's links must honour it)."""
    token_file = tmp_path_factory.mktemp("explorer-secret") / "token"
    token_file.write_text(TOKEN + "\n")
    deploy({"auth_token_file": str(token_file), "num_cpus": 0.5}, "explorer-secured", "/explorer-secured",
           default_bundle)
    url = f"{ray_serve.url}/explorer-secured"
    # serve.run returns when the replica is up; the ingress routes the new prefix a moment later
    # (until then the app at / answers, with 404)
    wait_until(lambda: httpx.get(f"{url}/explorer", timeout=30).status_code == 200, "the ingress to route the new app")
    yield url
    from ray import serve

    serve.delete("explorer-secured")


# ---------- GET / and the assets, over plain HTTP ----------


class Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []  # (tag, url)

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("href", "src", "action") and value:
                self.links.append((tag, value))


def links_of(html: str) -> list[tuple[str, str]]:
    parser = Links()
    parser.feed(html)
    return parser.links


def test_root_points_to_the_explorer_the_docs_and_info(service_url):
    page = httpx.get(f"{service_url}/", headers={"accept": "text/html,application/xhtml+xml,*/*;q=0.8"}, timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    hrefs = {url for tag, url in links_of(page.text) if tag == "a"}
    assert {"/explorer", "/docs", "/info"} <= hrefs, hrefs
    data = httpx.get(f"{service_url}/", timeout=30)  # curl and friends: the same links as JSON
    assert data.headers["content-type"] == "application/json" and "accept" in data.headers["vary"].lower()
    assert data.json()["links"] == {"explorer": "/explorer", "docs": "/docs", "info": "/info"}
    for href in ("/explorer", "/docs", "/info"):
        assert httpx.get(f"{service_url}{href}", timeout=30).status_code == 200, href


def test_explorer_assets_ship_with_the_service(service_url):
    page = httpx.get(f"{service_url}/explorer", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    csp = page.headers["content-security-policy"]  # the browser itself refuses anything from elsewhere
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
    assert not re.search(r"https?://", page.text), "the page names an absolute URL"
    expected = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
    assets = {url for tag, url in links_of(page.text) if tag in ("script", "link") and not url.startswith("data:")}
    assert {"/explorer/assets/explorer.js", "/explorer/assets/explorer.css"} <= assets, assets
    for url in assets:
        assert urlsplit(url).netloc == "", url
        r = httpx.get(urljoin(f"{service_url}/explorer", url), timeout=30)
        assert r.status_code == 200, url
        assert r.headers["content-type"] == expected[Path(url).suffix], (url, r.headers["content-type"])
        outside = set(re.findall(r"https?://[^\s'\"`)]+", r.text)) - NAMESPACES
        assert not outside, f"{url} names URLs outside the service: {outside}"
    for name in ("index.html", "nope.js", "..%2Fhttp/routes/explorer.py", "explorer.js.map"):
        r = httpx.get(f"{service_url}/explorer/assets/{name}", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found", (name, r.text)


# ---------- the page in Chromium ----------


def test_page_loads_without_console_errors(browser, service_url, info):
    console_errors(browser)
    open_page(browser, explorer_url(service_url), analysis=None)
    assert console_errors(browser) == []
    badge = browser.find_element("id", "model-badge").text
    assert info["model"] in badge and f"{info['num_layers']} layers" in badge and f"{info['num_heads']} heads" in badge
    assert browser.find_element("id", "empty").is_displayed()
    assert not browser.find_element("id", "results").is_displayed()


def test_text_in_the_address_renders_every_layer_and_head(browser, service_url, info):
    console_errors(browser)
    text = PAIR[0]
    open_page(browser, explorer_url(service_url, text))
    assert console_errors(browser) == []
    assert browser.find_element("id", "text-a").get_attribute("value") == text
    layers, heads = info["num_layers"], info["num_heads"]
    cells = cell_pixels(browser)
    assert len(cells) == layers * heads
    assert {(int(c["layer"]), int(c["head"])) for c in cells} == {(l, h) for l in range(layers) for h in range(heads)}
    # every heatmap is drawn from this text's weights: the darkest pixel is the head's strongest weight
    api = httpx.post(f"{service_url}/v1/attention", json={"inputs": text, "weights": True, "summaries": []}, timeout=60)
    item = api.json()["data"][0]
    weights, n = item["attention"]["data"], item["n_units"]
    for c in cells:
        assert c["tag"] == "CANVAS" and c["width"] == c["height"] == n and c["opaque"], c
        assert c["std"] > 5, f"cell {c['layer']}x{c['head']} is blank: {c}"
        square = weights[int(c["layer"])][int(c["head"])]
        strongest = max(max(row) for row in square)
        i, j = divmod(c["darkest_at"], n)
        # colours are a 256-step ramp of sqrt(weight): equal to the strongest within one or two steps
        assert math.sqrt(square[i][j]) >= math.sqrt(strongest) - 2 / 255, (c, square[i][j], strongest)


def test_clicking_a_cell_opens_its_head_view(browser, service_url):
    from selenium.webdriver.common.action_chains import ActionChains

    console_errors(browser)
    open_page(browser, explorer_url(service_url, PAIR[0]))
    cell = browser.find_element("css selector", '#model-view .cell[data-layer="3"][data-head="7"]')
    cell.click()
    view = browser.find_element("id", "head-view")
    assert (view.get_attribute("data-layer"), view.get_attribute("data-head")) == ("3", "7")
    assert "layer 3, head 7" in browser.find_element("id", "head-title").text
    assert "selected" in cell.get_attribute("class")
    assert view.find_element("css selector", "canvas.hv-matrix").get_attribute("data-head") == "7"
    left = view.find_elements("css selector", ".hv-col.left .hv-unit")
    right = view.find_elements("css selector", ".hv-col.right .hv-unit")
    assert len(left) == len(right) > 2 and left[1].text == "the"
    everything = len(view.find_elements("css selector", "svg line"))
    # hovering a unit follows it: only its own row of lines stays
    ActionChains(browser).move_to_element(left[2]).perform()
    assert "hot" in left[2].get_attribute("class")
    ys = {line.get_attribute("y1") for line in view.find_elements("css selector", "svg line")}
    assert len(ys) == 1 and 0 < everything
    # choosing a unit there drives the rollout and its top-k
    left[2].click()
    assert browser.find_element("id", "token-title").text == "Rollout from “cat”"
    assert len(browser.find_elements("css selector", "#topk li")) == 5
    assert console_errors(browser) == []


def test_two_texts_show_the_similarity_coloured_by_contribution(browser, service_url):
    console_errors(browser)
    open_page(browser, explorer_url(service_url, *PAIR))
    assert console_errors(browser) == []
    api = httpx.post(f"{service_url}/v1/similarity", json={"pairs": [list(PAIR)], "explain": True}, timeout=60).json()
    expected = api["data"][0]
    assert browser.find_element("id", "sim-score").text == f"{expected['score']:.3f}"
    for box, text in zip(("sim-a", "sim-b"), expected["texts"], strict=True):
        chips = browser.find_elements("css selector", f"#{box} .sim-unit")
        assert [c.text for c in chips] == [u["text"] for u in text["units"]]
        for chip, unit in zip(chips, text["units"], strict=True):
            r, g, b = rgb(chip.value_of_css_property("background-color"))
            assert (r, g, b) != (0, 0, 0) and "rgba(0, 0, 0, 0)" not in chip.value_of_css_property("background-color")
            if abs(unit["contribution"]) > 0.01:  # blue adds to the score, red takes from it
                assert (b > r) == (unit["contribution"] > 0), (unit, (r, g, b))
    # one tab per text; the second shows its own heatmaps
    tabs = browser.find_elements("css selector", "#text-tabs button")
    assert len(tabs) == 2
    tabs[1].click()
    n_b = len(expected["texts"][1]["units"])
    assert {c["width"] for c in cell_pixels(browser)} == {n_b}
    capture(browser, SCREENSHOT)
    assert console_errors(browser) == []


def test_with_auth_on_the_page_asks_for_the_token(browser, secured_url, info):
    url = explorer_url(secured_url, PAIR[0])
    # The browser still holds a keep-alive connection to the HAProxy process from before the new
    # app was added, and a reloaded HAProxy answers one last request on such a connection with its
    # old routes (404 here) before closing it; a second load goes through the new process.
    wait_until(lambda: browser.get(url) or browser.execute_script("return 'root' in document.body.dataset"),
               "the browser to reach the new app", timeout=30)
    console_errors(browser)
    open_page(browser, url, analysis="needs-token")
    assert console_errors(browser) == []  # no request was refused: the page knew to ask first
    box = browser.find_element("id", "token-box")
    assert box.is_displayed() and browser.find_elements("css selector", "#model-view .cell") == []
    field = browser.find_element("id", "api-token")
    assert field.get_attribute("type") == "password" and browser.switch_to.active_element == field
    field.send_keys("wrong-token")
    browser.find_element("id", "analyse").click()
    wait_until(lambda: browser.execute_script("return document.body.dataset.analysis") == "needs-token"
               and browser.find_element("id", "error").is_displayed(), "the refusal to be shown", timeout=30)
    assert "bearer token" in browser.find_element("id", "error").text
    field.clear()
    field.send_keys(TOKEN)
    browser.find_element("id", "analyse").click()
    wait_until(lambda: browser.execute_script("return document.body.dataset.analysis") == "done",
               "the analysis with the token", timeout=30)
    assert not browser.find_element("id", "error").is_displayed()
    assert len(cell_pixels(browser)) == info["num_layers"] * info["num_heads"]
    # the browser itself logs the refused request (a 401); nothing else went wrong
    assert all("401" in message for message in console_errors(browser))
    assert browser.execute_script("return location.pathname") == "/explorer-secured/explorer"


def reach(driver, url: str) -> None:
    """Load `url` until the app behind it answers: a keep-alive connection from before the app was added may
    get one last answer from HAProxy's old routes (a 404; see test_with_auth_on_the_page_asks_for_the_token)."""
    wait_until(lambda: driver.get(url) or driver.execute_script("return 'root' in document.body.dataset"),
               f"the browser to reach {url}", timeout=30)


@pytest.mark.parametrize("model", ["colbert", "bge-m3"])
def test_rerank_explorer_draws_the_maxsim_match_of_a_late_interaction_model(browser, representations_url, model):
    """The rerank explorer on a late-interaction model (the representation models' app): each ranked document
    gets a drawing of its MaxSim, one line per query token to the document token it matched best (by position),
    as wide as its share; on BGE-M3 also the shared sparse terms as bars, largest product first."""
    query, documents = "where is the cat", ["The cat sat on the mat.", "Stock markets fell today.", "A cat and a dog."]
    expected = httpx.post(f"{representations_url}/v1/rerank", json={
        "model": model, "query": query, "documents": documents, "explain": True}, timeout=60).json()["results"]
    url = (f"{representations_url}/explorer/rerank?model={model}&query={quote(query)}"
           + "".join(f"&doc={quote(d)}" for d in documents))
    reach(browser, url)
    console_errors(browser)
    open_page(browser, url)
    assert console_errors(browser) == []
    items = browser.find_elements("css selector", "#ranked .ranked-item")
    assert [int(i.get_attribute("data-index")) for i in items] == [r["index"] for r in expected]
    for item, result in zip(items, expected, strict=True):
        assert item.find_element("css selector", ".ranked-score").text == f"{result['relevance_score']:.3f}"
        matches = result["explanation"]["maxsim"]
        drawing = item.find_element("css selector", "svg.maxsim")
        assert drawing.is_displayed()
        assert [t.get_attribute("textContent") for t in drawing.find_elements("css selector", "text.query")] == \
            [m["query_token"] for m in matches]
        lines = drawing.find_elements("css selector", "line")
        assert [int(line.get_attribute("data-document-position")) for line in lines] == \
            [m["document_position"] for m in matches]
        widths = [float(line.get_attribute("stroke-width")) for line in lines]
        assert widths.index(max(widths)) == max(range(len(matches)), key=lambda k: matches[k]["share"]), widths
        # every matched document token is drawn once, in document order, and each line ends at its own
        drawn = {int(t.get_attribute("data-position")): t for t in drawing.find_elements("css selector", "text.document")}
        assert sorted(drawn) == sorted({m["document_position"] for m in matches})
        for line, m in zip(lines, matches, strict=True):
            assert drawn[m["document_position"]].get_attribute("textContent") == m["document_token"]
            assert line.get_attribute("y2") == drawn[m["document_position"]].get_attribute("y")
        bars = item.find_elements("css selector", ".terms li")
        if model == "bge-m3":
            assert [b.get_attribute("data-token") for b in bars] == [t["token"] for t in result["explanation"]["terms"][:8]]
        else:
            assert bars == []
    if model == "bge-m3":  # "the" is shared with the first document: at least one bar is drawn
        assert browser.find_elements("css selector", "#ranked .terms li"), expected


def test_explorer_draws_the_sparse_vector_of_a_model_that_has_one(browser, representations_url):
    """The attention explorer on BGE-M3: beside attention and similarity, each text's largest sparse weights as
    bars, in /v1/encode's terms, largest first."""
    url = explorer_url(representations_url, *PAIR) + "&model=bge-m3"
    reach(browser, url)
    console_errors(browser)
    open_page(browser, url)
    assert console_errors(browser) == []
    assert browser.find_element("id", "sparse-card").is_displayed()
    data = httpx.post(f"{representations_url}/v1/encode", json={
        "model": "bge-m3", "inputs": list(PAIR), "embedding": False, "sparse": True, "sparse_tokens": True,
        "top_k": 12}, timeout=60).json()["data"]
    for k, item in enumerate(data):
        terms = sorted(zip(item["sparse"]["values"], item["sparse"]["tokens"], strict=True), key=lambda t: -t[0])
        bars = browser.find_elements("css selector", f'#sparse-texts .sparse-text[data-text="{k}"] li')
        assert [b.get_attribute("data-token") for b in bars] == [token for _, token in terms] != []
        assert bars[0].find_element("css selector", ".value").text == f"{terms[0][0]:.4f}"


# ---------- the screenshot ----------


def capture(driver, path: Path, head: tuple[int, int] = (1, 8), unit: int = 2) -> Path:
    """The whole page as it stands (the first text's tab), with one head and one unit chosen, as a PNG."""
    from selenium.webdriver.common.action_chains import ActionChains

    for tab in driver.find_elements("css selector", "#text-tabs button")[:1]:
        tab.click()
    driver.find_element("css selector", f'#model-view .cell[data-layer="{head[0]}"][data-head="{head[1]}"]').click()
    units = driver.find_elements("css selector", "#rollout .chip")
    units[min(unit, len(units) - 1)].click()
    ActionChains(driver).move_to_element(driver.find_element("css selector", ".topbar .brand")).perform()
    driver.execute_script("window.scrollTo(0, 0)")
    size = driver.get_window_size()
    # the window as tall as the page (plus whatever the window itself takes), so all of it is shot
    height = driver.execute_script(
        "return document.documentElement.scrollHeight + window.outerHeight - window.innerHeight")
    driver.set_window_size(size["width"], height)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(path)), f"could not write {path}"
    finally:
        driver.set_window_size(size["width"], size["height"])
    return path


def main(argv: list[str]) -> None:
    """Capture the explorer of the service at argv[0] into argv[1], with PAIR analysed."""
    url, out = argv
    driver = chromium_driver()
    try:
        open_page(driver, explorer_url(url.rstrip("/"), *PAIR))
        print(capture(driver, Path(out)))
    finally:
        driver.quit()


if __name__ == "__main__":
    main(sys.argv[1:])

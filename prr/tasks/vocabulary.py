"""Small built-in word lists for the synthetic tasks (keys of needles, variable names, the
word lists of cwe). Written out here so generation needs no download and no extra package."""

ADJECTIVES = (
    "ancient", "bitter", "brave", "calm", "clever", "crimson", "curious", "damp", "eager", "elegant",
    "fancy", "fierce", "fragile", "gentle", "gloomy", "golden", "grumpy", "hollow", "humble", "icy",
    "jolly", "keen", "lively", "lonely", "lucky", "mellow", "misty", "noble", "odd", "pale",
    "polite", "proud", "quiet", "rapid", "rusty", "silent", "silver", "sleepy", "smooth", "sour",
    "spicy", "steady", "sticky", "swift", "tender", "tidy", "vivid", "wild", "witty", "young",
)
NOUNS = (
    "anchor", "badger", "banner", "basket", "beacon", "canyon", "castle", "cherry", "cobra", "comet",
    "dolphin", "dragon", "falcon", "feather", "forest", "garden", "glacier", "harbor", "helmet", "island",
    "jacket", "jungle", "kettle", "ladder", "lantern", "lemon", "magnet", "meadow", "mirror", "monkey",
    "needle", "orchid", "otter", "parrot", "pepper", "pillow", "planet", "pocket", "rabbit", "river",
    "rocket", "saddle", "shadow", "spider", "statue", "tiger", "tunnel", "violin", "wagon", "walrus",
)

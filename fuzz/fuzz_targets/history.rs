//! Usage-history files (`store::history::UsageHistory::load`), for a model of three layers
//! with 0, 4 and 8 routed experts. A file that cannot be used must give an empty history and
//! a warning, never an error (the fingerprint is plain) or a panic; a history that loads
//! holds finite, non-negative counts, and once saved it round-trips: load → save → load →
//! save → load gives the same counts and token totals the second and third time.
#![no_main]

use colibri::store::history::UsageHistory;
use libfuzzer_sys::fuzz_target;

const FINGERPRINT: &str = "fuzz-model";
const SHAPE: [usize; 3] = [0, 4, 8];

/// Every count, layer by layer, and the totals.
fn summary(h: &UsageHistory) -> (Vec<f64>, u64, u64) {
    let counts = SHAPE
        .iter()
        .enumerate()
        .flat_map(|(l, &n)| (0..n).map(move |e| (l, e)))
        .map(|(l, e)| h.count(l, e))
        .collect();
    (counts, h.tokens(), h.since_save())
}

fuzz_target!(|data: &[u8]| {
    let dir = colibri_fuzz::scratch("history");
    let path = UsageHistory::path(&dir, FINGERPRINT).unwrap();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, data).unwrap();
    let (mut h, warning) =
        UsageHistory::load(&dir, FINGERPRINT, &SHAPE).expect("a plain fingerprint never errors");
    assert_eq!(h.experts_per_layer(), SHAPE);
    if let Some(w) = &warning {
        assert!(h.is_empty(), "a refused file gives an empty history: {w}");
        return;
    }
    let (counts, _, _) = summary(&h);
    assert!(
        counts.iter().all(|c| c.is_finite() && *c >= 0.0),
        "{counts:?}"
    );
    h.save(&dir).expect("a loaded history saves");
    let (mut second, w) = UsageHistory::load(&dir, FINGERPRINT, &SHAPE).unwrap();
    assert_eq!(w, None, "a saved history loads without a warning");
    second.save(&dir).unwrap();
    let (third, w) = UsageHistory::load(&dir, FINGERPRINT, &SHAPE).unwrap();
    assert_eq!(w, None);
    assert_eq!(
        summary(&third),
        summary(&second),
        "save → load is not a round trip"
    );
});

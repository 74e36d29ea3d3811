//! `torch.topk` as PyTorch computes it on the CPU, ties included.
//!
//! When several scores tie at the k-th place, which of them `torch.topk` keeps is decided by
//! the selection algorithm it runs: `std::nth_element` (or `std::partial_sort` when
//! `64·k ≤ n`) from libstdc++ over `(value, index)` pairs, comparing values only
//! (ATen's `topk_impl_loop`, NaN counted as largest). The sparse-attention indexers of
//! GLM-5 and DeepSeek-V4 hit such ties in practice — a score is exactly 0 whenever every
//! head's ReLU is 0 — and the tied keys are not interchangeable for the attention that
//! follows. [`torch_topk`] replays those algorithms step for step, so the same row gives the
//! same pick transformers makes. A row is what transformers scores in one forward call: its
//! length (and so the pick among ties) depends on the call, which is why the indexers pass
//! the call's extent (see `mla::Mla::select` and `deepseek_v4`).

/// An element of the selection: the value compared, and its index in the row.
type Elem = (f32, usize);

/// `comp(x, y)` of ATen's largest-first top-k: NaN before numbers, then larger first.
#[inline]
fn before(x: &Elem, y: &Elem) -> bool {
    (x.0.is_nan() && !y.0.is_nan()) || x.0 > y.0
}

/// The indices of the `k` largest of `values`, exactly as `torch.topk(values, k)` returns
/// them on the CPU (largest first where it sorts, in its order where ties are involved).
/// `k` is clamped to the row's length.
pub fn torch_topk(values: &[f32], k: usize) -> Vec<usize> {
    select(values, k, true)
}

/// The same indices as [`torch_topk`], in no particular order: for callers that only need
/// which entries were picked (the indexers sort them ascending), it skips torch's final sort.
pub fn torch_topk_set(values: &[f32], k: usize) -> Vec<usize> {
    select(values, k, false)
}

fn select(values: &[f32], k: usize, sorted: bool) -> Vec<usize> {
    let n = values.len();
    let k = k.min(n);
    if k == 0 {
        return Vec::new();
    }
    let mut q: Vec<Elem> = values.iter().copied().zip(0..n).collect();
    if k * 64 <= n {
        // std::partial_sort = __heap_select + __sort_heap.
        heap_select(&mut q, k);
        if sorted {
            sort_heap(&mut q[..k]);
        }
    } else {
        nth_element(&mut q, k - 1);
        // std::sort(first, first + k - 1): only the order of the first k - 1 changes, not
        // which elements are in the first k.
        if sorted {
            sort_range(&mut q[..k - 1]);
        }
    }
    q[..k].iter().map(|e| e.1).collect()
}

/// `std::nth_element(first, first + nth, last)`: libstdc++'s `__introselect` with depth
/// limit `2·⌊log2 n⌋`.
fn nth_element(v: &mut [Elem], nth: usize) {
    let n = v.len();
    if n == 0 || nth >= n {
        return;
    }
    let mut depth = 2 * (usize::BITS - 1 - n.leading_zeros()) as usize;
    let (mut first, mut last) = (0usize, n);
    while last - first > 3 {
        if depth == 0 {
            heap_select(&mut v[first..last], nth + 1 - first);
            v.swap(first, nth);
            return;
        }
        depth -= 1;
        let cut = first + unguarded_partition_pivot(&mut v[first..last]);
        if cut <= nth {
            first = cut;
        } else {
            last = cut;
        }
    }
    insertion_sort(&mut v[first..last]);
}

/// `__unguarded_partition_pivot`: median of (1, mid, last − 1) moved to 0, then the
/// partition of `1..` around it. Returns the cut (relative to `v`).
fn unguarded_partition_pivot(v: &mut [Elem]) -> usize {
    let n = v.len();
    let mid = n / 2;
    move_median_to_first(v, 0, 1, mid, n - 1);
    // __unguarded_partition(first + 1, last, pivot = first).
    let (mut lo, mut hi) = (1usize, n);
    loop {
        while before(&v[lo], &v[0]) {
            lo += 1;
        }
        hi -= 1;
        while before(&v[0], &v[hi]) {
            hi -= 1;
        }
        if lo >= hi {
            return lo;
        }
        v.swap(lo, hi);
        lo += 1;
    }
}

/// `__move_median_to_first(result, a, b, c)`.
fn move_median_to_first(v: &mut [Elem], result: usize, a: usize, b: usize, c: usize) {
    let pick = if before(&v[a], &v[b]) {
        if before(&v[b], &v[c]) {
            b
        } else if before(&v[a], &v[c]) {
            c
        } else {
            a
        }
    } else if before(&v[a], &v[c]) {
        a
    } else if before(&v[b], &v[c]) {
        c
    } else {
        b
    };
    v.swap(result, pick);
}

/// `__insertion_sort(first, last)`.
fn insertion_sort(v: &mut [Elem]) {
    for i in 1..v.len() {
        let val = v[i];
        if before(&val, &v[0]) {
            // move_backward(first, i, i + 1); *first = val.
            v.copy_within(0..i, 1);
            v[0] = val;
        } else {
            // __unguarded_linear_insert(i).
            let mut j = i;
            while before(&val, &v[j - 1]) {
                v[j] = v[j - 1];
                j -= 1;
            }
            v[j] = val;
        }
    }
}

/// `std::sort(first, last)`: libstdc++'s introsort (`__introsort_loop` with depth
/// `2·⌊log2 n⌋` down to runs of 16, then `__final_insertion_sort`).
fn sort_range(v: &mut [Elem]) {
    let n = v.len();
    if n < 2 {
        return;
    }
    let depth = 2 * (usize::BITS - 1 - n.leading_zeros()) as usize;
    introsort_loop(v, depth);
    // __final_insertion_sort.
    if n > 16 {
        insertion_sort(&mut v[..16]);
        for i in 16..n {
            // __unguarded_linear_insert: the minimum is already among the first 16, so the
            // scan stops before index 0 (the bound only guards against a broken order).
            let val = v[i];
            let mut j = i;
            while j > 0 && before(&val, &v[j - 1]) {
                v[j] = v[j - 1];
                j -= 1;
            }
            v[j] = val;
        }
    } else {
        insertion_sort(v);
    }
}

/// `__introsort_loop(first, last, depth)`.
fn introsort_loop(v: &mut [Elem], mut depth: usize) {
    let (first, mut last) = (0usize, v.len());
    while last - first > 16 {
        if depth == 0 {
            // std::__partial_sort(first, last, last) = heap select over everything + sort_heap.
            heap_select(&mut v[first..last], last - first);
            sort_heap(&mut v[first..last]);
            return;
        }
        depth -= 1;
        let cut = first + unguarded_partition_pivot(&mut v[first..last]);
        introsort_loop(&mut v[cut..last], depth);
        last = cut;
    }
}

/// `__heap_select(first, first + middle, last)`: a heap of the first `middle`, then each
/// later element that beats its top replaces it.
fn heap_select(v: &mut [Elem], middle: usize) {
    make_heap(&mut v[..middle]);
    for i in middle..v.len() {
        if before(&v[i], &v[0]) {
            // __pop_heap(first, middle, i).
            let value = v[i];
            v[i] = v[0];
            adjust_heap(&mut v[..middle], 0, value);
        }
    }
}

/// `__make_heap(first, last)`.
fn make_heap(v: &mut [Elem]) {
    let len = v.len();
    if len < 2 {
        return;
    }
    let mut parent = (len - 2) / 2;
    loop {
        let value = v[parent];
        adjust_heap(v, parent, value);
        if parent == 0 {
            return;
        }
        parent -= 1;
    }
}

/// `__sort_heap(first, last)`.
fn sort_heap(v: &mut [Elem]) {
    let mut last = v.len();
    while last > 1 {
        last -= 1;
        // __pop_heap(first, last, last).
        let value = v[last];
        v[last] = v[0];
        adjust_heap(&mut v[..last], 0, value);
    }
}

/// `__adjust_heap(first, hole, len, value)` over the whole of `v`.
fn adjust_heap(v: &mut [Elem], mut hole: usize, value: Elem) {
    let len = v.len();
    let top = hole;
    let mut child = hole;
    while child < len.saturating_sub(1) / 2 {
        child = 2 * (child + 1);
        if before(&v[child], &v[child - 1]) {
            child -= 1;
        }
        v[hole] = v[child];
        hole = child;
    }
    if len >= 2 && len.is_multiple_of(2) && child == (len - 2) / 2 {
        child = 2 * (child + 1);
        v[hole] = v[child - 1];
        hole = child - 1;
    }
    // __push_heap(first, hole, top, value).
    while hole > top {
        let parent = (hole - 1) / 2;
        if !before(&v[parent], &value) {
            break;
        }
        v[hole] = v[parent];
        hole = parent;
    }
    v[hole] = value;
}

#[cfg(test)]
mod tests {
    use super::torch_topk;

    /// Without ties the pick is the k largest, whatever the algorithm.
    #[test]
    fn distinct_values_give_the_k_largest() {
        let mut state = 12345u64;
        for n in [1usize, 2, 3, 4, 5, 17, 64, 200, 1000] {
            // A shuffled 0..n: distinct by construction.
            let mut values: Vec<f32> = (0..n).map(|i| i as f32).collect();
            for i in (1..n).rev() {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                values.swap(i, (state >> 33) as usize % (i + 1));
            }
            for k in [1usize, 2, 3, n / 2, n] {
                if k == 0 || k > n {
                    continue;
                }
                let mut got = torch_topk(&values, k);
                let mut want: Vec<usize> = (0..n).collect();
                want.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
                want.truncate(k);
                got.sort_unstable();
                want.sort_unstable();
                assert_eq!(got, want, "n {n} k {k}");
            }
        }
    }

    /// Rows full of ties, against what torch.topk returned for them
    /// (engine/tests/oracle/torch_topk_vectors.py): the same indices in the same order.
    #[test]
    fn ties_are_broken_as_torch_breaks_them() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/torch_topk.json"
        );
        let text = std::fs::read_to_string(path).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let cases = v["cases"].as_array().unwrap();
        assert!(cases.len() > 500);
        let mut differ = Vec::new();
        for (i, c) in cases.iter().enumerate() {
            let values: Vec<f32> = c["values"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| match x.as_f64() {
                    Some(f) => f as f32,
                    None => f32::NEG_INFINITY,
                })
                .collect();
            let k = c["k"].as_u64().unwrap() as usize;
            let want: Vec<usize> = c["indices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect();
            let got = torch_topk(&values, k);
            let mut set = super::torch_topk_set(&values, k);
            let mut sorted_got = got.clone();
            set.sort_unstable();
            sorted_got.sort_unstable();
            assert_eq!(
                set, sorted_got,
                "case {i}: the set differs from the sorted pick"
            );
            if got != want {
                differ.push(format!(
                    "case {i} (n {}, k {k}): {got:?} vs torch {want:?}",
                    values.len()
                ));
            }
        }
        assert!(
            differ.is_empty(),
            "{} cases differ:\n{}",
            differ.len(),
            differ.join("\n")
        );
    }
}

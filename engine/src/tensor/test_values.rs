//! Deterministic pseudo-random inputs for the kernels' unit tests (one generator per stream
//! shape, so every test module draws exactly the values it always did).

/// `n` values in `[-1, 1)` from a 32-bit xorshift seeded by `seed`.
pub fn xorshift(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect()
}

/// The multiplier of the 64-bit LCG ([`lcg`]).
pub const LCG_MUL: u64 = 6364136223846793005;
/// The increment of the 64-bit LCG ([`lcg`]).
pub const LCG_INC: u64 = 1442695040888963407;

/// `n` values in `[-0.5, 0.5)`: the top 24 bits of each step of a 64-bit LCG that starts at
/// `state`.
pub fn lcg(n: usize, mut state: u64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            state = state.wrapping_mul(LCG_MUL).wrapping_add(LCG_INC);
            ((state >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

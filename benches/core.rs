//! Per-record costs of the core: decode, decide and encode at clock widths 1..64, the cost
//! of releasing a held chain of depth r and a burst of k records (per-record slope), and a
//! projector step as its throughput benchmark feeds one (`step`).

use std::collections::{BTreeMap, BTreeSet};
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use parsley::codec::{self, DEFAULT_METADATA_BUDGET};
use parsley::{decide, CausalPast, ChannelId, Engine, EngineConfig, Fed, Receipt, TopicId};

const WIDTHS: [usize; 4] = [1, 4, 16, 64];

/// A past naming `width` channels spread over topics of 4 partitions each.
fn past_of_width(width: usize) -> CausalPast {
    CausalPast::from_pairs((0..width).map(|i| {
        let mut id = [0u8; 16];
        id[0] = 1 + (i / 4) as u8;
        id[15] = 7;
        (ChannelId::new(TopicId::from_bytes(id), (i % 4) as u32), 1_000_000 + i as i64)
    }))
}

fn codec_and_decide(c: &mut Criterion) {
    let mut group = c.benchmark_group("per_record");
    for width in WIDTHS {
        let past = past_of_width(width);
        let bytes = past.encode();
        // The task receives half the channels the record names; all are settled.
        let received: BTreeSet<ChannelId> = past.iter().map(|(c, _)| c).step_by(2).collect();
        let settled: BTreeMap<ChannelId, i64> = past.iter().map(|(c, p)| (c, p + 1)).collect();
        group.bench_with_input(BenchmarkId::new("decode", width), &bytes, |b, bytes| {
            b.iter(|| codec::decode(black_box(bytes), DEFAULT_METADATA_BUDGET).unwrap())
        });
        group.bench_with_input(BenchmarkId::new("decide", width), &past, |b, past| {
            b.iter(|| decide(black_box(past), &received, |c| settled.get(c).copied()))
        });
        group.bench_with_input(BenchmarkId::new("encode", width), &past, |b, past| b.iter(|| black_box(past).encode()));
        group.bench_with_input(BenchmarkId::new("decode_decide_encode", width), &bytes, |b, bytes| {
            b.iter(|| {
                let p = codec::decode(black_box(bytes), DEFAULT_METADATA_BUDGET).unwrap();
                let d = decide(&p, &received, |c| settled.get(c).copied());
                (d, p.encode())
            })
        });
    }
    group.finish();
}

const CAUSE: ChannelId = ChannelId::new(TopicId::from_bytes([1; 16]), 0);
const EFFECTS: ChannelId = ChannelId::new(TopicId::from_bytes([2; 16]), 0);

fn fresh() -> Engine<u64> {
    let mut e = Engine::new(EngineConfig::default(), [CAUSE, EFFECTS]);
    e.seed(CAUSE, -1).unwrap();
    e.seed(EFFECTS, -1).unwrap();
    e
}

/// `depth` records on one channel held behind a head whose cause is missing, then the cause
/// arrives: the whole chain is released by one receive.
fn held_chain(depth: usize) -> (Engine<u64>, Vec<u8>) {
    let mut e = fresh();
    let header = CausalPast::from_pairs([(CAUSE, 0)]).encode();
    for i in 0..depth {
        let h: Vec<Option<&[u8]>> = if i == 0 { vec![Some(&header)] } else { vec![] };
        e.receive(EFFECTS, i as i64, &h, i as u64).unwrap();
    }
    assert_eq!(e.held_count(), depth);
    (e, header)
}

fn release(c: &mut Criterion) {
    let mut group = c.benchmark_group("release_chain");
    for depth in [1usize, 16, 256, 4096] {
        group.throughput(Throughput::Elements(depth as u64));
        group.bench_function(BenchmarkId::from_parameter(depth), |b| {
            b.iter_batched(
                || held_chain(depth).0,
                |mut e| match e.receive(CAUSE, 0, &[], 0).unwrap() {
                    Receipt::Accepted { deliveries } => assert_eq!(deliveries.len(), depth + 1),
                    Receipt::Duplicate => unreachable!(),
                },
                criterion::BatchSize::LargeInput,
            )
        });
    }
    group.finish();

    // A burst of k deliverable records, each carrying a width-16 header: receive + drain +
    // take_changes, as a host step does.
    let mut group = c.benchmark_group("burst");
    let header = past_of_width(16).encode();
    for k in [1usize, 16, 256, 4096] {
        group.throughput(Throughput::Elements(k as u64));
        group.bench_function(BenchmarkId::from_parameter(k), |b| {
            b.iter_batched(
                fresh,
                |mut e| {
                    for i in 0..k {
                        e.receive(EFFECTS, i as i64, &[Some(&header)], i as u64).unwrap();
                    }
                    e.take_changes()
                },
                criterion::BatchSize::LargeInput,
            )
        });
    }
    group.finish();
}

/// The projector's common step, as its throughput benchmark feeds it: one received channel,
/// 2 000 records in order, each carrying six pairs on an upstream topic of 16 partitions and
/// a payload of the projector's size (96 bytes), every one deliverable at once; then the
/// step's changes taken. Per-record slope of what the engine adds to a step.
fn step(c: &mut Criterion) {
    const RECORDS: usize = 2_000;
    let upstream = TopicId::from_bytes([0x42; 16]);
    let headers: Vec<Vec<u8>> = (0..RECORDS)
        .map(|i| {
            let pairs =
                (0..6u32).map(|j| (ChannelId::new(upstream, (i as u32 + j * 5) % 16), (i / 4 + j as usize) as i64));
            CausalPast::from_pairs(pairs).encode()
        })
        .collect();
    let fresh = || {
        let mut e: Engine<[u64; 12]> = Engine::new(EngineConfig::default(), [EFFECTS]);
        e.seed(EFFECTS, -1).unwrap();
        e
    };
    let mut group = c.benchmark_group("step");
    group.throughput(Throughput::Elements(RECORDS as u64));
    group.bench_function("upstream_6", |b| {
        b.iter_batched(
            fresh,
            |mut e| {
                let mut delivered = Vec::with_capacity(RECORDS);
                for (i, header) in headers.iter().enumerate() {
                    match e.receive(EFFECTS, i as i64, &[Some(header)], [i as u64; 12]).unwrap() {
                        Receipt::Accepted { deliveries } => delivered.extend(deliveries),
                        Receipt::Duplicate => unreachable!(),
                    }
                }
                (delivered, e.take_changes())
            },
            criterion::BatchSize::LargeInput,
        )
    });
    // The same step fed as the projector feeds it: every delivery appended to the step's
    // one list (`receive_into`) instead of a list per record.
    group.bench_function("upstream_6_into", |b| {
        b.iter_batched(
            fresh,
            |mut e| {
                let mut delivered = Vec::with_capacity(RECORDS);
                for (i, header) in headers.iter().enumerate() {
                    let fed = e.receive_into(EFFECTS, i as i64, &[Some(header)], [i as u64; 12], &mut delivered);
                    assert_eq!(fed, Ok(Fed::Accepted));
                }
                (delivered, e.take_changes())
            },
            criterion::BatchSize::LargeInput,
        )
    });
    group.finish();
}

criterion_group!(benches, codec_and_decide, release, step);
criterion_main!(benches);

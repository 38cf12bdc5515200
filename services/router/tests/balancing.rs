//! Balancing policies, BUSY avoidance, outlier ejection and replacement of re-registered
//! instances, against real agents on 127.0.0.1:0.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use common::*;
use reach_proto::v1::{InstanceState, Payload, ReachMessage};
use reach_router::balance::{Random, SeededRandom};
use reach_router::config::{BalancingConfig, EjectionConfig};
use reach_router::{Policy, RouterConfig};
use reach_sdk::{AgentRuntime, CallOptions, HandlerContext};

fn with_policy(policy: Policy) -> RouterConfig {
    RouterConfig {
        balancing: BalancingConfig {
            default: policy,
            ..BalancingConfig::default()
        },
        ..RouterConfig::default()
    }
}

/// Calls `capability` `n` times from `parallel` closed-loop workers and counts the instances
/// that answered.
async fn spread(
    router: &TestRouter,
    capability: &str,
    n: usize,
    parallel: usize,
) -> HashMap<String, usize> {
    let client = router.client().await;
    let workers = (0..parallel).map(|w| {
        let client = client.clone();
        let calls = n / parallel + usize::from(w < n % parallel);
        async move {
            let mut ids = Vec::with_capacity(calls);
            for _ in 0..calls {
                ids.push(
                    client
                        .call(capability, Payload::text("t", "x"), CallOptions::default())
                        .await
                        .expect("call")
                        .route
                        .unwrap()
                        .instance_id,
                );
            }
            ids
        }
    });
    let mut counts = HashMap::new();
    for ids in futures::future::join_all(workers).await {
        for id in ids {
            *counts.entry(id).or_default() += 1;
        }
    }
    counts
}

async fn three_echo_agents(
    registry: &TestRegistry,
    weights: [u32; 3],
) -> Vec<reach_sdk::runtime::RunningAgent> {
    let mut agents = Vec::new();
    for (i, weight) in weights.into_iter().enumerate() {
        let mut config = config("echo", &format!("echo-{i}"), &registry.url);
        config.weight = weight;
        let (agent, _) = agent(echo_agent(config, "echo", Arc::new(AtomicUsize::new(0)))).await;
        agents.push(agent);
    }
    agents
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_visits_every_instance_in_turn() {
    let registry = registry().await;
    let _agents = three_echo_agents(&registry, [1, 1, 1]).await;
    let router = router(&registry.url, with_policy(Policy::RoundRobin)).await;
    router.wait_routable(3).await;
    let counts = spread(&router, "echo", 30, 1).await;
    assert_eq!(counts.len(), 3, "{counts:?}");
    assert!(counts.values().all(|&n| n == 10), "{counts:?}");
}

/// The seed of the routers whose random picks the tests replay.
const SEED: u64 = 13;

/// Replays `calls` draws of a source seeded with [`SEED`], mapping each onto an instance id
/// with `instance`: what the router's picks must have been.
fn replay(calls: usize, n: u64, instance: impl Fn(u64) -> &'static str) -> HashMap<String, usize> {
    let random = SeededRandom::new(SEED);
    let mut counts = HashMap::new();
    for _ in 0..calls {
        *counts
            .entry(instance(random.below(n)).to_string())
            .or_default() += 1;
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_picks_are_the_seeded_draws() {
    let registry = registry().await;
    let _agents = three_echo_agents(&registry, [1, 1, 1]).await;
    let router = router_with_random(
        &registry.url,
        with_policy(Policy::Random),
        Arc::new(SeededRandom::new(SEED)),
    )
    .await;
    router.wait_routable(3).await;
    // One draw per call whichever worker makes it, so the counts do not depend on timing.
    let counts = spread(&router, "echo", 300, 8).await;
    let expected = replay(300, 3, |i| ["echo-0", "echo-1", "echo-2"][i as usize]);
    assert_eq!(counts, expected);
    assert_eq!(expected.len(), 3, "every instance was drawn: {expected:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weighted_picks_follow_registration_weights() {
    let registry = registry().await;
    let _agents = three_echo_agents(&registry, [1, 1, 6]).await;
    let router = router_with_random(
        &registry.url,
        with_policy(Policy::Weighted),
        Arc::new(SeededRandom::new(SEED)),
    )
    .await;
    router.wait_routable(3).await;
    let counts = spread(&router, "echo", 800, 8).await;
    // A draw below the total weight 8: 0 is echo-0's, 1 echo-1's, 2..=7 echo-2's.
    let expected = replay(800, 8, |point| match point {
        0 => "echo-0",
        1 => "echo-1",
        _ => "echo-2",
    });
    assert_eq!(counts, expected);
    let heavy = expected["echo-2"] as f64 / 800.0;
    assert!(
        (0.68..=0.82).contains(&heavy),
        "share {heavy}: {expected:?}"
    );
}

/// A fast and a slowed instance of `echo`.
async fn fast_and_slow(registry: &TestRegistry) -> Vec<reach_sdk::runtime::RunningAgent> {
    let fast = echo_agent(
        config("echo", "fast", &registry.url),
        "echo",
        Arc::new(AtomicUsize::new(0)),
    );
    let slow = AgentRuntime::new(config("echo", "slow", &registry.url)).handle(
        "echo",
        "1.0.0",
        |ctx: HandlerContext, _m: ReachMessage| async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            Ok(Payload::text("echo", ctx.instance_id.to_string()))
        },
    );
    vec![agent(fast).await.0, agent(slow).await.0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2c_peak_ewma_favours_the_fast_instance() {
    let registry = registry().await;
    let _agents = fast_and_slow(&registry).await;
    let router = router(&registry.url, with_policy(Policy::P2cPeakEwma)).await;
    router.wait_routable(2).await;
    let counts = spread(&router, "echo", 100, 1).await;
    let fast = counts.get("fast").copied().unwrap_or(0);
    assert!(fast >= 80, "{counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2c_pending_favours_the_fast_instance() {
    let registry = registry().await;
    let _agents = fast_and_slow(&registry).await;
    let router = router(&registry.url, with_policy(Policy::P2cPending)).await;
    router.wait_routable(2).await;
    let counts = spread(&router, "echo", 200, 8).await;
    let fast = counts.get("fast").copied().unwrap_or(0);
    assert!(fast >= 120, "{counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_instances_are_avoided_while_others_have_room() {
    let registry = registry().await;
    let (real, endpoint) = agent(echo_agent(
        config("echo", "real", &registry.url),
        "echo",
        Arc::new(AtomicUsize::new(0)),
    ))
    .await;
    // A second instance id served by the same process, which then reports BUSY.
    let (lease, _) = register(
        &registry.registry,
        "echo",
        "busy",
        &endpoint,
        &[("echo", "1.0.0")],
    );
    let router = router(&registry.url, with_policy(Policy::RoundRobin)).await;
    router.wait_routable(2).await;
    registry
        .registry
        .heartbeat("busy", &lease, InstanceState::Busy, 8)
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), async {
        while router
            .router
            .table()
            .instances()
            .iter()
            .all(|i| i.state != InstanceState::Busy)
        {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .unwrap();
    let counts = spread(&router, "echo", 20, 1).await;
    assert_eq!(counts.get("real"), Some(&20), "{counts:?}");
    drop(real);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_instances_are_ejected_and_return_after_recovery() {
    let metrics = reach_telemetry::metrics::install().unwrap();
    let ejections = || {
        metric(
            &metrics.render(),
            "reach_router_ejections_total",
            &[("service", "echo"), ("instance", "flaky")],
        )
    };
    let registry = registry().await;
    let (_real, _) = agent(echo_agent(
        config("echo", "steady", &registry.url),
        "echo",
        Arc::new(AtomicUsize::new(0)),
    ))
    .await;
    let (dead, port) = dead_endpoint().await;
    register(
        &registry.registry,
        "echo",
        "flaky",
        &dead,
        &[("echo", "1.0.0")],
    );
    let config = RouterConfig {
        ejection: EjectionConfig {
            consecutive_failures: 2,
            base_ejection: Duration::from_millis(300),
            max_ejection: Duration::from_secs(5),
        },
        ..with_policy(Policy::RoundRobin)
    };
    let router = router(&registry.url, config).await;
    router.wait_routable(2).await;

    // Connect errors are provably undelivered: every call still succeeds on `steady`.
    let counts = spread(&router, "echo", 10, 1).await;
    assert_eq!(counts.get("steady"), Some(&10), "{counts:?}");
    let flaky = |router: &TestRouter| {
        router
            .router
            .table()
            .instances()
            .into_iter()
            .find(|i| i.instance_id == "flaky")
            .unwrap()
    };
    assert!(flaky(&router).ejected, "flaky should be ejected");
    // At least once: if this test runs slowly, it can be ejected again after its first
    // interval, on its first failure back.
    assert!(ejections() >= 1.0, "the ejection was not counted");
    assert_eq!(
        metric(
            &metrics.render(),
            "reach_router_ejections_total",
            &[("service", "echo"), ("instance", "steady")]
        ),
        0.0,
        "the healthy instance was never ejected"
    );

    // The instance comes back at the same address; after the ejection interval it takes
    // traffic again.
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let mut revived = config_for_revived(&registry.url);
    revived.registry_endpoint = "http://127.0.0.1:1".into(); // registers by hand above
    let (_revived, _) = echo_agent(revived, "echo", Arc::new(AtomicUsize::new(0)))
        .start(listener)
        .await
        .unwrap();
    let served = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let counts = spread(&router, "echo", 4, 1).await;
            if counts.contains_key("flaky") {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(
        served.is_ok(),
        "the recovered instance never got traffic again"
    );
    assert!(!flaky(&router).ejected);
}

fn config_for_revived(registry: &str) -> reach_sdk::AgentConfig {
    config("echo", "revived", registry)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_re_registered_instance_replaces_the_old_endpoint_at_once() {
    let registry = registry().await;
    let answer = |label: &'static str| {
        AgentRuntime::new(reach_sdk::AgentConfig {
            registry_endpoint: "http://127.0.0.1:1".into(),
            ..config(label, label, &registry.url)
        })
        .handle("who", "1.0.0", move |_c: HandlerContext, _m: ReachMessage| async move {
            Ok(Payload::text("who", label))
        })
    };
    let (_old, old_endpoint) = agent(answer("old")).await;
    let (_new, new_endpoint) = agent(answer("new")).await;
    register(
        &registry.registry,
        "who",
        "moving",
        &old_endpoint,
        &[("who", "1.0.0")],
    );
    let router = router(&registry.url, RouterConfig::default()).await;
    router.wait_routable(1).await;
    let client = router.client().await;
    let text = |r: reach_proto::v1::CallResponse| {
        r.message
            .unwrap()
            .payload
            .unwrap()
            .first_text()
            .unwrap()
            .to_string()
    };
    let first = client
        .call("who", Payload::text("t", ""), CallOptions::default())
        .await
        .unwrap();
    assert_eq!(text(first), "old");
    let (_, revision) = register(
        &registry.registry,
        "who",
        "moving",
        &new_endpoint,
        &[("who", "1.0.0")],
    );
    router.wait_revision(revision).await;
    for _ in 0..20 {
        let reply = client
            .call("who", Payload::text("t", ""), CallOptions::default())
            .await
            .unwrap();
        assert_eq!(text(reply), "new");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_instance_leaves_rotation_at_its_first_refused_connection() {
    let metrics = reach_telemetry::metrics::install().unwrap();
    let attempts_on = |instance: &str| {
        metric(
            &metrics.render(),
            "reach_router_instance_duration_seconds_count",
            &[("service", "refused"), ("instance", instance)],
        )
    };
    let registry = registry().await;
    let (_survivor, _) = agent(echo_agent(
        config("refused", "refused-survivor", &registry.url),
        "refused",
        Arc::new(AtomicUsize::new(0)),
    ))
    .await;
    // The victim runs on a runtime of its own: dropping that runtime kills it as a crashed
    // host would be (its sockets close, it never drains, and its lease stays live).
    let host = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let registry_url = registry.url.clone();
    let (victim, _) = host
        .spawn(async move {
            agent(echo_agent(
                config("refused", "refused-victim", &registry_url),
                "refused",
                Arc::new(AtomicUsize::new(0)),
            ))
            .await
        })
        .await
        .unwrap();
    let config = RouterConfig {
        ejection: EjectionConfig {
            // Well above the calls below, and an interval longer than they can take.
            consecutive_failures: 5,
            base_ejection: Duration::from_secs(60),
            max_ejection: Duration::from_secs(60),
        },
        ..with_policy(Policy::RoundRobin)
    };
    let router = router(&registry.url, config).await;
    router.wait_routable(2).await;
    let warm = spread(&router, "refused", 10, 1).await;
    assert_eq!(warm.get("refused-victim"), Some(&5), "{warm:?}");

    let before = attempts_on("refused-victim");
    tokio::task::spawn_blocking(move || drop(host))
        .await
        .unwrap();
    drop(victim);

    // Every call succeeds (`spread` fails on an error): the refused attempt was retried on
    // the survivor, and the victim was tried once, not `consecutive_failures` times.
    let counts = spread(&router, "refused", 40, 1).await;
    assert_eq!(counts.get("refused-survivor"), Some(&40), "{counts:?}");
    assert_eq!(
        attempts_on("refused-victim") - before,
        1.0,
        "the dead instance was picked again after its connection was refused"
    );
    let victim = router
        .router
        .table()
        .instances()
        .into_iter()
        .find(|i| i.instance_id == "refused-victim")
        .expect("still registered: its lease is live");
    assert!(victim.ejected, "the dead instance is ejected");
}

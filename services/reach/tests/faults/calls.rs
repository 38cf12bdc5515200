//! Steady unary calls through the router while a fault strikes: one caller, one call after
//! another to `complaint.classify`, each with a 2 s deadline, tallied until stopped.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_proto::v1::{CallRequest, Header, Payload, ReachMessage, header};

/// What the calls came to: how many succeeded, and each failure as `CODE: message`.
#[derive(Debug, Default)]
pub struct Tally {
    /// Calls answered OK.
    pub ok: usize,
    /// Failed calls, described.
    pub failed: Vec<String>,
}

/// A caller running until [`Steady::stop`].
pub struct Steady {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Tally>,
}

impl Steady {
    /// Starts calling through the router at `router_url`.
    pub fn start(router_url: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let url = router_url.to_string();
        let task = tokio::spawn(call_until(url, stop.clone()));
        Self { stop, task }
    }

    /// Stops calling and returns the tally.
    pub async fn stop(self) -> Tally {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.expect("the caller panicked")
    }
}

async fn call_until(url: String, stop: Arc<AtomicBool>) -> Tally {
    let mut tally = Tally::default();
    // The router is up (the mesh started): a connection failure here is a failure too.
    let mut router = match RouterServiceClient::connect(url).await {
        Ok(router) => router,
        Err(error) => {
            tally
                .failed
                .push(format!("cannot connect to the router: {error}"));
            return tally;
        }
    };
    let mut n = 0u64;
    while !stop.load(Ordering::SeqCst) {
        n += 1;
        let mut request = tonic::Request::new(classify(n));
        request.set_timeout(Duration::from_secs(2));
        match router.call(request).await {
            Ok(_) => tally.ok += 1,
            Err(status) => tally
                .failed
                .push(format!("{:?}: {}", status.code(), status.message())),
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tally
}

fn classify(n: u64) -> CallRequest {
    let complaint = serde_json::json!({
        "complaint_id": format!("steady-{n}"),
        "narrative": "my credit report shows an account that is not mine",
        "company": "Example Bank",
        "state": "CA",
    });
    CallRequest {
        message: Some(ReachMessage {
            header: Some(Header {
                target: Some(header::Target::Capability("complaint.classify".into())),
                ..Default::default()
            }),
            payload: Some(Payload::json("complaint.submitted", &complaint)),
        }),
    }
}

-- Order totals per customer: the orders and payments topics are keyed by customer (so they
-- are co-partitioned by it), each record's value names its order or payment.
--
-- IF NOT EXISTS: the examples' tests run many models (one per run) over these same tables,
-- each model applying the folder once; a deployment with one model would not need it.
CREATE SCHEMA IF NOT EXISTS totals;

CREATE TABLE IF NOT EXISTS totals.orders (
    id       text    PRIMARY KEY,
    customer text    NOT NULL,
    amount   numeric NOT NULL CHECK (amount >= 0)
);
CREATE INDEX IF NOT EXISTS orders_by_customer ON totals.orders (customer);

CREATE TABLE IF NOT EXISTS totals.payments (
    id       text    PRIMARY KEY,
    order_id text    NOT NULL,
    customer text    NOT NULL,
    amount   numeric NOT NULL CHECK (amount > 0)
);
CREATE INDEX IF NOT EXISTS payments_by_customer ON totals.payments (customer);

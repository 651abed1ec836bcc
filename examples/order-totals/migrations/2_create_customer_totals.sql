-- What each customer ordered and paid: the named query `customer_total` reads it.
CREATE OR REPLACE VIEW totals.customer_totals AS
SELECT customer,
       coalesce(o.ordered, 0) AS ordered,
       coalesce(p.paid, 0)    AS paid
FROM (SELECT customer, sum(amount) AS ordered FROM totals.orders GROUP BY customer) o
FULL JOIN (SELECT customer, sum(amount) AS paid FROM totals.payments GROUP BY customer) p USING (customer);
